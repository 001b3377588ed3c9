#!/usr/bin/env bash
# Check the alert rules and the Grafana dashboard of deploy/ against a running relay's metrics.
#
#   bash deploy/check.sh NAMES_FILE
#
# NAMES_FILE: the metric names a live daemon serves at /metrics, one per line (counters with
# their `_total`, histograms by their family name; `_bucket`, `_sum`, `_count` and `_created`
# lines are accepted too). Blank lines and lines starting with `#` are ignored.
#
# 1. promtool check rules / test rules on deploy/prometheus/outbox-alerts{,.test}.yml
#    (Debian's `prometheus` package is installed with apt-get when promtool is missing);
# 2. the dashboard parses (jq), has its `datasource` and `relay` variables, and its PromQL
#    parses (promtool, with the Grafana variables replaced);
# 3. every `outbox_…` metric name in the rules' and the dashboard's expressions (a histogram's
#    `_bucket`/`_sum`/`_count` stripped) is in NAMES_FILE, and every recording rule an
#    expression uses is defined.
# Exits non-zero naming what failed.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
rules="$here/prometheus/outbox-alerts.yml"
tests="$here/prometheus/outbox-alerts.test.yml"
dashboard="$here/grafana/outbox-dashboard.json"

die() { printf 'check.sh: error: %s\n' "$*" >&2; exit 1; }
log() { printf '==> %s\n' "$*"; }

[ $# -eq 1 ] || die "usage: bash deploy/check.sh NAMES_FILE (the metric names a live relay serves, one per line)"
names_file="$1"
[ -r "$names_file" ] || die "cannot read the metric names file '$names_file'"
for f in "$rules" "$tests" "$dashboard"; do [ -r "$f" ] || die "missing $f"; done

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo -n "$@"
  else return 1
  fi
}

apt_updated=0
apt_install() { # package…
  command -v apt-get >/dev/null 2>&1 || return 1
  if [ "$apt_updated" -eq 0 ]; then
    as_root apt-get update -qq >/dev/null || return 1
    apt_updated=1
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# --- tools ------------------------------------------------------------------------------------
if ! command -v promtool >/dev/null 2>&1; then
  log "promtool is missing: installing Debian's prometheus package (it contains promtool)"
  apt_install prometheus || true
  command -v promtool >/dev/null 2>&1 ||
    die "promtool is required and could not be installed (apt-get install prometheus failed or apt-get is not available); install promtool (it ships with Prometheus) and run again"
fi
if ! command -v jq >/dev/null 2>&1; then
  log "jq is missing: installing it"
  apt_install jq || true
  command -v jq >/dev/null 2>&1 || die "jq is required and could not be installed (apt-get install jq)"
fi
# A Python 3 with PyYAML reads the rules' expressions.
python=""
for p in python3 /usr/bin/python3; do
  if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import yaml' 2>/dev/null; then python="$p"; break; fi
done
if [ -z "$python" ]; then
  log "PyYAML is missing: installing python3-yaml"
  apt_install python3 python3-yaml || true
  /usr/bin/python3 -c 'import yaml' 2>/dev/null && python=/usr/bin/python3
  [ -n "$python" ] || die "Python 3 with PyYAML is required to read the rules and could not be installed (apt-get install python3-yaml)"
fi

failed=0
fail() { printf 'FAILED: %s\n' "$*" >&2; failed=1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# --- 1. rules ---------------------------------------------------------------------------------
log "$(promtool --version 2>&1 | head -n 1)"
log "promtool check rules $rules"
promtool check rules "$rules" || fail "promtool check rules"
log "promtool test rules $tests"
(cd "$(dirname "$tests")" && promtool test rules "$(basename "$tests")") || fail "promtool test rules"

# --- 2. dashboard -----------------------------------------------------------------------------
log "dashboard: $dashboard"
if ! jq empty "$dashboard" 2>"$work/jq.err"; then
  cat "$work/jq.err" >&2
  die "the dashboard is not valid JSON"
fi
jq -e '.schemaVersion | type == "number"' "$dashboard" >/dev/null || fail "dashboard: no schemaVersion"
jq -e '[.templating.list[] | select(.name == "datasource" and .type == "datasource" and .query == "prometheus")] | length == 1' \
  "$dashboard" >/dev/null || fail "dashboard: no 'datasource' variable of type datasource (prometheus)"
jq -e '[.templating.list[] | select(.name == "relay" and .type == "query")
        | (.query | if type == "object" then .query else . end) | select(test("^label_values\\("))] | length == 1' \
  "$dashboard" >/dev/null || fail "dashboard: no 'relay' variable from label_values(…)"
jq -e '[.panels[] | select(.type != "row")] | length > 0' "$dashboard" >/dev/null || fail "dashboard: no panels"
# Panel expressions (rows may nest panels when collapsed) and variable queries.
jq -r '[.. | objects | select(has("expr")) | .expr | strings] | .[]' "$dashboard" >"$work/dashboard.exprs"
jq -r '.templating.list[] | select(.type == "query") | (.query | if type == "object" then .query else . end) | strings' \
  "$dashboard" >"$work/dashboard.queries"
[ -s "$work/dashboard.exprs" ] || fail "dashboard: no expressions"
# The panels' PromQL must parse: put it in a rules file, Grafana variables replaced.
"$python" - "$work/dashboard.exprs" "$work/dashboard-rules.yml" <<'EOF'
import json, re, sys
exprs = [l for l in open(sys.argv[1]).read().splitlines() if l.strip()]
def plain(e):
    e = re.sub(r"\$__(rate_interval|interval|range)\b", "5m", e)
    return re.sub(r"\$\{?\w+\}?", ".*", e)
rules = [{"record": f"dashboard:expression_{i}", "expr": plain(e)} for i, e in enumerate(exprs, 1)]
json.dump({"groups": [{"name": "dashboard", "rules": rules}]}, open(sys.argv[2], "w"))
EOF
log "dashboard PromQL: promtool check rules ($(wc -l <"$work/dashboard.exprs") expressions)"
promtool check rules "$work/dashboard-rules.yml" >"$work/promtool-dash.out" 2>&1 || {
  cat "$work/promtool-dash.out" >&2
  fail "dashboard: an expression does not parse (dashboard:expression_N is the file's N-th expression)"
}

# --- 3. metric names --------------------------------------------------------------------------
log "metric names against $names_file"
"$python" - "$names_file" "$rules" "$work/dashboard.exprs" "$work/dashboard.queries" <<'EOF' || fail "metric names"
import re, sys, yaml

names_file, rules_file, dash_exprs, dash_queries = sys.argv[1:]
SUFFIXES = ("_bucket", "_sum", "_count")

known = set()
for line in open(names_file):
    n = line.strip()
    if not n or n.startswith("#"):
        continue
    known.add(n)
    for s in SUFFIXES + ("_created",):
        if n.endswith(s):
            known.add(n[: -len(s)])
if not any(n.startswith("outbox_") for n in known):
    print(f"{names_file}: no outbox_ metric name in it", file=sys.stderr)
    sys.exit(1)

doc = yaml.safe_load(open(rules_file))
exprs, records = [], set()
for g in doc.get("groups", []):
    for r in g.get("rules", []):
        where = f"{rules_file}: {'record ' + r['record'] if 'record' in r else 'alert ' + r.get('alert', '?')}"
        exprs.append((where, str(r["expr"])))
        if "record" in r:
            records.add(r["record"])
for path in (dash_exprs, dash_queries):
    for i, line in enumerate(open(path), 1):
        if line.strip():
            exprs.append((f"dashboard ({'expression' if path == dash_exprs else 'variable query'} {i})", line))

TOKEN = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
bad, used = [], set()
for where, e in exprs:
    for tok in TOKEN.findall(STRING.sub('""', e)):
        if ":" in tok:
            if tok not in records:
                bad.append(f"{where}: recording rule {tok} is not defined in {rules_file}")
            continue
        if not tok.startswith("outbox_"):
            continue
        name = tok
        if name not in known:
            for s in SUFFIXES:
                if name.endswith(s) and name[: -len(s)] in known:
                    name = name[: -len(s)]
                    break
        if name in known:
            used.add(name)
            for s in SUFFIXES:
                if name.endswith(s):
                    used.add(name[: -len(s)])
        else:
            bad.append(f"{where}: {tok} is not in {names_file}")

for b in bad:
    print(b, file=sys.stderr)
unused = sorted(n for n in known if n.startswith("outbox_") and n not in used
                and not n.endswith(SUFFIXES + ("_created",)))
families = {n for n in used if not n.endswith(SUFFIXES)}
print(f"{len(families)} outbox_ metric names used, all in {names_file}" if not bad else f"{len(bad)} unknown name(s)")
if unused:
    print("served but used by no rule or panel: " + ", ".join(unused))
sys.exit(1 if bad else 0)
EOF

if [ "$failed" -ne 0 ]; then
  echo "check.sh: FAILED (see above)" >&2
  exit 1
fi
log "check.sh: all checks passed"
