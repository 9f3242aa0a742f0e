-- +goose Up
-- compute_now() that PostgreSQL can inline. The first version's
-- body had a sub-select (the test clock's offset), so it could not be
-- inlined and ran through the SQL-function executor, its body planned
-- again in every statement that called it: about 60 µs of database CPU per
-- statement, a quarter of PostgreSQL's CPU per join (a join's statements
-- call it about 17 times). The offset is now read by a PL/pgSQL function,
-- whose plan each backend keeps, and compute_now() is a plain expression
-- that the planner inlines.
--
-- Expand only, and safe while replicas of the previous release run: the
-- language of compute_now() stays SQL. (Replacing it with a PL/pgSQL
-- function in place made the previous release's backends, which had the
-- function cached as SQL, parse the new PL/pgSQL body as SQL: "syntax
-- error at or near RETURN", caught by TestRollingUpgrade.) Both bodies are
-- valid SQL, and the helper exists before the new body does (one
-- transaction).
-- +goose StatementBegin
CREATE FUNCTION compute_clock_offset() RETURNS BIGINT LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT offset_ms FROM compute_clock WHERE id = 1);
END
$$;
-- +goose StatementEnd
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION compute_now() RETURNS BIGINT LANGUAGE SQL STABLE AS $$
    SELECT (extract(epoch FROM statement_timestamp()) * 1000)::BIGINT + compute_clock_offset()
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION compute_now() RETURNS BIGINT LANGUAGE SQL STABLE AS $$
    SELECT (extract(epoch FROM statement_timestamp()) * 1000)::BIGINT
         + (SELECT offset_ms FROM compute_clock WHERE id = 1)
$$;
-- +goose StatementEnd
DROP FUNCTION compute_clock_offset();
