#!/usr/bin/env bash
# Checks deploy/: the Prometheus alerting rules (`promtool check rules`, and
# the unit tests in alerts_test.yml that fire and do not fire each alert),
# the Grafana dashboard (valid JSON), and that every PromQL expression in
# both names only metrics that pgelect/src/metrics.rs defines. Fails, never
# skips: without promtool it installs it (as root on Debian/Ubuntu, through
# scripts/setup.sh) or says how.
set -euo pipefail
cd "$(dirname "$0")/.."

rules=deploy/prometheus/alerts.yml
tests=deploy/prometheus/alerts_test.yml
dashboard=deploy/grafana/pgelect.json
metrics=pgelect/src/metrics.rs

fail() { echo "check-deploy: FAILED: $*" >&2; exit 1; }

if ! command -v promtool >/dev/null 2>&1; then
  scripts/setup.sh --promtool || fail "promtool is missing and could not be installed (see above); the alerting rules are not checked"
  command -v promtool >/dev/null 2>&1 || fail "promtool is still not on PATH after installing prometheus"
fi

promtool check rules "$rules" || fail "promtool check rules $rules"
promtool test rules "$tests" || fail "promtool test rules $tests"

# The dashboard must parse as JSON (any of these parsers will do; the
# PostgreSQL packages the tests need bring perl with JSON::PP).
if command -v python3 >/dev/null 2>&1; then
  python3 -m json.tool "$dashboard" >/dev/null || fail "$dashboard is not valid JSON"
elif command -v jq >/dev/null 2>&1; then
  jq empty "$dashboard" || fail "$dashboard is not valid JSON"
elif perl -MJSON::PP -e 1 2>/dev/null; then
  perl -MJSON::PP -e 'local $/; open my $f, "<", $ARGV[0] or die "$!\n"; JSON::PP->new->decode(<$f>)' "$dashboard" \
    || fail "$dashboard is not valid JSON"
else
  fail "no JSON parser to check $dashboard: install python3 or jq"
fi
echo "check-deploy: $dashboard is valid JSON"

# Every expression of the dashboard parses as PromQL: promtool checks them
# as recording rules, with Grafana's variables replaced by sample values.
exprs_file=$(mktemp -d)/dashboard-exprs.yml
trap 'rm -rf "$(dirname "$exprs_file")"' EXIT
{
  echo "groups: [{name: dashboard, rules: ["
  grep -oE '"expr": "([^"\\]|\\.)*"' "$dashboard" \
    | sed -e 's/^"expr": //' \
          -e 's/\$role/.*/g; s/\$__rate_interval/1m/g; s/\$__interval/1m/g; s/\$__range_s/3600/g; s/\$__range/1h/g' \
    | awk '{ printf "  {record: \"dashboard:expr%d\", expr: %s},\n", NR, $0 }'
  echo "]}]"
} > "$exprs_file"
n_exprs=$(grep -c 'record:' "$exprs_file")
[ "$n_exprs" -gt 0 ] || fail "no expressions found in $dashboard"
promtool check rules "$exprs_file" >/dev/null || fail "an expression of $dashboard is not valid PromQL (dashboard:exprN is its Nth \"expr\", see above)"
echo "check-deploy: the $n_exprs expressions of $dashboard parse"

# Every pgelect_* name in the dashboard and the rules is a metric of metrics.rs; the
# exporter renders the histograms as summaries, so those also have _sum and
# _count (and no _bucket).
known=$(grep -oE '"pgelect_[a-z_]+"' "$metrics" | tr -d '"' | sort -u)
[ -n "$known" ] || fail "found no metric names in $metrics"
histograms=$(grep -B3 -E 'pub const [A-Z_]+: &str = "pgelect_' "$metrics" \
  | awk '/Histogram/ { h = 1 } /pub const/ { if (h) { match($0, /"pgelect_[a-z_]+"/); print substr($0, RSTART + 1, RLENGTH - 2) } h = 0 }')
allowed=$(printf '%s\n' $known; for h in $histograms; do printf '%s_sum\n%s_count\n' "$h" "$h"; done)

# The dashboard names metrics only in its expressions and the role
# variable's query; the rules also in their annotations. Each is checked.
exprs=$(cat "$dashboard" "$rules")
used=$(printf '%s\n' "$exprs" | grep -oE 'pgelect_[a-z_]+' | sort -u)
unknown=$(comm -23 <(printf '%s\n' "$used") <(printf '%s\n' "$allowed" | sort -u))
[ -z "$unknown" ] || fail "expressions name metrics that $metrics does not define: $(echo $unknown)"
echo "check-deploy: expressions use $(echo "$used" | wc -l) metric names, all defined in $metrics"
echo "check-deploy: OK"
