-- +goose Up
-- compute_now() as PL/pgSQL (issue 11). The SQL-language version cannot be
-- inlined (its body has a sub-select), so PostgreSQL ran it through the
-- SQL-function executor, planning its body again in every statement that
-- calls it: about 60 µs of database CPU per statement, a quarter of
-- PostgreSQL's CPU per join (a join's statements call it about 17 times).
-- PL/pgSQL keeps the body's plan for the session: about 5 µs. Same
-- signature, volatility and result, so replicas of the previous release
-- run beside it unchanged (expand only).
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION compute_now() RETURNS BIGINT LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (extract(epoch FROM statement_timestamp()) * 1000)::BIGINT
         + (SELECT offset_ms FROM compute_clock WHERE id = 1);
END
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION compute_now() RETURNS BIGINT LANGUAGE SQL STABLE AS $$
    SELECT (extract(epoch FROM statement_timestamp()) * 1000)::BIGINT
         + (SELECT offset_ms FROM compute_clock WHERE id = 1)
$$;
-- +goose StatementEnd
