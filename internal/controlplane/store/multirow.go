package store

import "strings"

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
