# The seed's Table 1 (pretraining), Table 2 (finetuning), a runtime projection and plots, from the results files.
#   snakemake report                                       # results/report/ (runs: report.runs + existing results)
#   snakemake report && snakemake --report results/report/report.html   # one HTML file with the tables and plots

REPORT = f"{RESULTS}/report"


rule report:
    input:
        report_inputs,
    output:
        table1_csv=report(f"{REPORT}/table1_pretraining.csv", caption="../report/table1.rst", category="Tables"),
        table1_md=f"{REPORT}/table1_pretraining.md",
        table2_csv=report(f"{REPORT}/table2_finetuning.csv", caption="../report/table2.rst", category="Tables"),
        table2_md=f"{REPORT}/table2_finetuning.md",
        projection_csv=report(f"{REPORT}/projection.csv", caption="../report/projection.rst", category="Tables"),
        projection_md=f"{REPORT}/projection.md",
        loss=report(f"{REPORT}/loss.png", caption="../report/loss.rst", category="Plots"),
        mfu=report(f"{REPORT}/mfu.png", caption="../report/mfu.rst", category="Plots"),
        busbw=report(f"{REPORT}/busbw.png", caption="../report/busbw.rst", category="Plots"),
        speedup=report(f"{REPORT}/speedup.png", caption="../report/speedup_all.rst", category="Plots"),
    log:
        f"{LOGS}/report/report.log",
    localrule: True
    params:
        runs=requested_runs,
        scaling=requested_scaling_studies,
        allreduce=requested_allreduce_nodes,
    script:
        "../scripts/run_rule.py"


# One training run's loss curve, MFU (or tokens/s) over batches and tracked-run location, for each run in the
# report (rule report's input): the report's "Runs" category, one subcategory per run.
rule report_run:
    input:
        train=f"{RESULTS}/{{run}}/train.json",
    output:
        loss=report(
            f"{REPORT}/runs/{{run}}/loss.png",
            caption="../report/run_loss.rst",
            category="Runs",
            subcategory="{run}",
        ),
        mfu=report(
            f"{REPORT}/runs/{{run}}/mfu.png",
            caption="../report/run_mfu.rst",
            category="Runs",
            subcategory="{run}",
        ),
        tracking=report(
            f"{REPORT}/runs/{{run}}/tracking.html",
            caption="../report/run_tracking.rst",
            category="Runs",
            subcategory="{run}",
        ),
    log:
        f"{LOGS}/report/run-{{run}}.log",
    localrule: True
    script:
        "../scripts/run_rule.py"
