# Broker clusters on loopback for the cluster tests (issue 18; docs/scaling.md): a 3-node NATS
# cluster with clustered JetStream, a 3-node RabbitMQ cluster (for quorum queues) and a Redis
# Cluster of 3 masters and 3 replicas, started by .ci/clusters.sh (which the tests also call to
# kill and restart nodes).
#
# Sourced by .ci/run (bash, `set -euo pipefail`). Idempotent: a node already listening is left
# alone. Exports OUTBOX_TEST_{NATS,RABBITMQ,REDIS}_CLUSTER_URL (seed lists) and
# OUTBOX_TEST_CLUSTERS (the path of .ci/clusters.sh), each kept when already set.

outbox_clusters_service() {
  local script
  script="$(pwd)/.ci/clusters.sh"
  bash "$script" up
  export OUTBOX_TEST_CLUSTERS="${OUTBOX_TEST_CLUSTERS:-$script}"
  local line
  while read -r line; do
    local name="${line#export }"
    name="${name%%=*}"
    if [ -z "${!name:-}" ]; then eval "$line"; fi
  done < <(bash "$script" urls)
  echo "clusters up: NATS 4241-4243, RabbitMQ 5681-5683, Redis 7001-7006"
}
outbox_clusters_service
