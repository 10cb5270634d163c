# Sourced by start.sh and stop.sh (needs DIR, the state folder): the names, subnet and ports of the test cluster of
# that folder. Each state folder gets its own index K (0 for the default /tmp/llmpipe-slurm, else 1..250 from a
# checksum of the path), so that the start/stop of one cluster never touches another's bridge, namespaces, veths,
# subnet, route or ports.
#   BR=llmpbrK (bridge)  NS=llmpK-n (namespaces llmpK-n1..)  VETH=llmpvKx (veths llmpvKx1..)  NET=10.214.K (/24);
#   K=0 keeps the names of before (llmp-n1.., llmpv1..), which no other K's names match
#   CTLD_PORT/SLURMD_PORT/DBD_PORT/DB_PORT: 16827/16828/16829/13326 + 10*K
#   ROUTE_METRIC: the metric of the unreachable route that keeps NET off the default route while the cluster lives
if [[ "$DIR" == /tmp/llmpipe-slurm ]]; then
  K=0
else
  K=$(( $(printf '%s' "$DIR" | cksum | cut -d' ' -f1) % 250 + 1 ))
fi
BR="llmpbr$K"; NET="10.214.$K"
if ((K == 0)); then NS=llmp-n; VETH=llmpv; else NS="llmp$K-n"; VETH="llmpv${K}x"; fi
CTLD_PORT=$((16827 + 10 * K)); SLURMD_PORT=$((16828 + 10 * K)); DBD_PORT=$((16829 + 10 * K)); DB_PORT=$((13326 + 10 * K))
ROUTE_METRIC=4242
