package store

import (
	"context"
	"strings"
)

// maxInsertRows is how many rows one multi-row INSERT carries at most; a
// longer list is written in several statements. It keeps a statement's
// parameters (rows × columns) far below SQLite's and PostgreSQL's limits.
const maxInsertRows = 64

// multiInsert is the text of an INSERT of 1 to maxInsertRows rows of one
// shape: "INSERT INTO t (cols) VALUES row, row, …". A transaction that
// writes several rows of one table (a join's events, its audit rows) sends
// one statement for them: on SQLite one program run instead of one per
// row, on PostgreSQL one statement to bind, plan and execute.
type multiInsert struct {
	texts [maxInsertRows + 1]string
}

// newMultiInsert builds the texts for head ("INSERT INTO t (cols) VALUES")
// and one row's values ("(?, ?, compute_now())").
func newMultiInsert(head, row string) *multiInsert {
	m := &multiInsert{}
	var b strings.Builder
	b.WriteString(head)
	for n := 1; n <= maxInsertRows; n++ {
		if n > 1 {
			b.WriteString(",")
		}
		b.WriteString(" ")
		b.WriteString(row)
		m.texts[n] = b.String()
	}
	return m
}

// sql is the text for n rows, 1 ≤ n ≤ maxInsertRows.
func (m *multiInsert) sql(n int) string { return m.texts[n] }

// insertRows writes count rows with m, in statements of at most
// maxInsertRows rows, held back like every insert (execLater). appendRow
// appends row i's cols arguments to args.
func (t *Tx) insertRows(ctx context.Context, m *multiInsert, count, cols int, appendRow func(args []any, i int) []any) error {
	for start := 0; start < count; start += maxInsertRows {
		n := min(count-start, maxInsertRows)
		args := make([]any, 0, cols*n)
		for i := start; i < start+n; i++ {
			args = appendRow(args, i)
		}
		if err := t.execLater(ctx, m.sql(n), args...); err != nil {
			return err
		}
	}
	return nil
}
