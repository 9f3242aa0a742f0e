package store

import "context"

// LockPool reads a pool for a read-modify-write: on PostgreSQL it locks the
// row until the transaction ends (SELECT … FOR UPDATE), so two concurrent
// changes of different policy fields both land instead of one overwriting
// the other with what it read before. SQLite runs one writer at a time.
func (t *Tx) LockPool(ctx context.Context, id string) (Pool, error) {
	q := "SELECT " + poolCols + " FROM pools WHERE id = ?"
	if t.db.dialect == Postgres {
		q += " FOR UPDATE"
	}
	p, err := scanPool(t.queryRow(ctx, q, id))
	return p, notFound(err)
}
