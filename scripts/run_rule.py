# Every rule's script: runs the step registered under the rule's name (llmpipe/steps/registry.py).
try:
    from llmpipe.steps import run_rule
except BaseException:   # the package did not import (e.g. two copies of llmpipe): the reason goes to the rule log
    import traceback

    with open(snakemake.log[0], "a") as fh:  # noqa: F821 - injected by Snakemake
        fh.write("ERROR: the rule script could not import llmpipe.steps:\n" + traceback.format_exc())
    raise

run_rule(snakemake)  # noqa: F821 - injected by Snakemake
