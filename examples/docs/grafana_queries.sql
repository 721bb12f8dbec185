-- The queue gauges straight from PostgreSQL, for a Grafana PostgreSQL data source:
-- monitoring_guide.py runs these two statements on its tasks table.
SELECT queue, count(*) AS pending,
       extract(epoch FROM now() - min(run_after) FILTER (WHERE run_after <= now())) AS oldest_runnable_seconds
FROM tasks WHERE status = 'pending' GROUP BY queue;
SELECT n_dead_tup, last_autovacuum FROM pg_stat_user_tables WHERE relid = 'tasks'::regclass;
