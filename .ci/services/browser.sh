# The dashboard's browser test (crates/outbox-cli/tests/daemon/dashboard.rs): Debian's chromium and
# playwright-core from npm (pinned by crates/outbox-cli/tests/browser/package-lock.json; no browser
# download: playwright-core drives the chromium installed here).
#
# Sourced by .ci/run (bash, `set -euo pipefail`, helpers `port_open`, `wait_port`, `log`).
# Idempotent: installs chromium only when /usr/bin/chromium is missing, runs `npm ci` only when
# playwright-core is not in node_modules. Exports CHROMIUM (kept when already set).

outbox_browser_service() {
  local dir
  dir="$(pwd)/crates/outbox-cli/tests/browser"
  if [ ! -x /usr/bin/chromium ]; then
    echo "installing Debian's chromium"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  fi
  if ! command -v node >/dev/null 2>&1; then
    echo "installing Debian's nodejs and npm"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
  fi
  if [ ! -d "$dir/node_modules/playwright-core" ]; then
    echo "installing playwright-core (npm ci in $dir)"
    (cd "$dir" && npm ci --no-audit --no-fund --silent)
  fi
  export CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"
  "$CHROMIUM" --version
}
outbox_browser_service
