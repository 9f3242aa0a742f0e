package store

import (
	"strconv"
	"strings"
)

// sqliteNow is compute_now() on SQLite: wall time in milliseconds plus the
// test offset.
const sqliteNow = "(CAST(unixepoch('subsec') * 1000 AS INTEGER) + (SELECT offset_ms FROM compute_clock WHERE id = 1))"

// rewrite turns the one SQL text into the dialect's, caching the result.
func (db *DB) rewrite(q string) string {
	if v, ok := db.stmt.Load(q); ok {
		return v.(string)
	}
	var out string
	switch db.dialect {
	case SQLite:
		out = strings.ReplaceAll(q, "compute_now()", sqliteNow)
	case Postgres:
		var b strings.Builder
		n := 0
		for i := 0; i < len(q); i++ {
			if q[i] == '?' {
				n++
				b.WriteByte('$')
				b.WriteString(strconv.Itoa(n))
				continue
			}
			b.WriteByte(q[i])
		}
		out = b.String()
	}
	db.stmt.Store(q, out)
	return out
}
