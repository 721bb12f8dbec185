# The dashboard's JSON API from the shell: $BASE is the API's root, $ORIGIN the
# dashboard's origin (see the page). examples/docs/dashboard_api.py runs this file.
set -euo pipefail

# --8<-- [start:read]
curl -s "$BASE/overview"                                     # every table: each queue's counts (the last hour)
curl -s "$BASE/overview?window=24h"                          # finished in the last 24 hours
curl -s "$BASE/tables/newsletter_jobs/activity?window=24h"   # the charts: each queue's buckets
curl -s "$BASE/tables/newsletter_jobs/schedules"             # its schedules, their last and next tick
curl -s "$BASE/tables/newsletter_jobs/dead?queue=mail&limit=20"     # dead letters, newest first
curl -s "$BASE/tables/newsletter_jobs/jobs?status=pending,running"  # the jobs page's filters
curl -s "$BASE/tables/newsletter_jobs/jobs/2"                # one job: every column, big values cut
curl -s "$BASE/tables/newsletter_jobs/jobs/2/values/last_error"     # one value, whole
curl -s "$BASE/tables/newsletter_jobs/workers"               # live workers, what each runs
# --8<-- [end:read]

# --8<-- [start:act]
# The token, and the session cookie it belongs to (cookies.txt):
TOKEN=$(curl -s -c cookies.txt "$BASE/csrf" | python3 -c 'import json, sys; print(json.load(sys.stdin)["csrf_token"])')

# Each action: the cookie, the token, the dashboard's own Origin, and a JSON body.
curl -s -b cookies.txt -X POST "$BASE/tables/newsletter_jobs/actions/requeue" \
     -H "X-CSRF-Token: $TOKEN" -H "Origin: $ORIGIN" -H "Content-Type: application/json" \
     -d '{"ids": [2]}'
curl -s -b cookies.txt -X POST "$BASE/tables/newsletter_jobs/actions/requeue_matching" \
     -H "X-CSRF-Token: $TOKEN" -H "Origin: $ORIGIN" -H "Content-Type: application/json" \
     -d '{"queue": ["mail"], "error": "SMTPError: 421"}'
# --8<-- [end:act]
