# Sourced by pg-pair.sh and pg-fleet.sh: more clusters of the installed PostgreSQL on this
# machine (Debian's pg_createcluster), trust auth on loopback.
#
# pg_clusters_init SCRIPT TOOL...   fail unless root and the cluster tools and TOOLs are there;
#                                   set V, the newest installed PostgreSQL version
# exists CLUSTER                    whether cluster CLUSTER of version V exists
# trust_loopback CLUSTER [LINE...]  its pg_hba.conf: trust on loopback, then each LINE

pg_clusters_init() {
  local script="$1" tool
  shift
  if [ "$(id -u)" != 0 ]; then
    echo "error: $script creates PostgreSQL clusters and must run as root" >&2
    exit 1
  fi
  for tool in pg_createcluster pg_ctlcluster pg_dropcluster pg_lsclusters psql "$@"; do
    command -v "$tool" >/dev/null || { echo "error: $tool is required (Debian postgresql-common, postgresql)" >&2; exit 1; }
  done
  V="$(ls /etc/postgresql | sort -n | tail -n 1)"
}

exists() { pg_lsclusters -h | awk '{print $1, $2}' | grep -qx "$V $1"; }

trust_loopback() {
  local c="$1"
  shift
  {
    echo "local all all trust"
    echo "host all all 127.0.0.1/32 trust"
    local line
    for line in "$@"; do echo "$line"; done
  } >"/etc/postgresql/$V/$c/pg_hba.conf"
}
