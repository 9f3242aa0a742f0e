package engine

import (
	"strings"
	"testing"
)

// The rewriter touches SQL proper only. The cases marked "was wrong" are the
// ones the earlier byte-by-byte rewriter got wrong: it took every ? for a
// placeholder and replaced every compute_now(), inside literals, quoted
// identifiers and comments too.
func TestRewriteSQL(t *testing.T) {
	for _, c := range []struct {
		name    string
		dialect Dialect
		in      string
		want    string
	}{
		{"pg placeholders", Postgres, "SELECT a FROM t WHERE b = ? AND c IN (?, ?) LIMIT ?", "SELECT a FROM t WHERE b = $1 AND c IN ($2, $3) LIMIT $4"},
		{"pg no placeholders", Postgres, "SELECT 1", "SELECT 1"},
		{"pg adjacent placeholders", Postgres, "??", "$1$2"},
		{"pg ten and more", Postgres, strings.Repeat("?,", 11) + "?", "$1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12"},
		{"pg compute_now kept", Postgres, "UPDATE t SET at = compute_now() WHERE id = ?", "UPDATE t SET at = compute_now() WHERE id = $1"},
		{"pg literals of the code base", Postgres, "UPDATE c SET state = 'expired' WHERE id = ? AND state IN ('queued', 'sent')", "UPDATE c SET state = 'expired' WHERE id = $1 AND state IN ('queued', 'sent')"},
		// was wrong: each of these took a quoted or commented ? for a
		// placeholder, numbering the real ones from $2.
		{"pg ? in a literal", Postgres, "SELECT '?' WHERE a = ?", "SELECT '?' WHERE a = $1"},
		{"pg ? in a JSON literal", Postgres, `SELECT a FROM t WHERE j = '{"q":"?"}' AND b = ?`, `SELECT a FROM t WHERE j = '{"q":"?"}' AND b = $1`},
		{"pg doubled quote", Postgres, "SELECT 'it''s ?' , ?", "SELECT 'it''s ?' , $1"},
		{"pg doubled quote at the end", Postgres, "SELECT '?''' , ?", "SELECT '?''' , $1"},
		{"pg empty literal", Postgres, "SELECT '', ?, ''", "SELECT '', $1, ''"},
		{"pg quoted identifier", Postgres, `SELECT "a?b", "c""?" FROM t WHERE x = ?`, `SELECT "a?b", "c""?" FROM t WHERE x = $1`},
		{"pg line comment", Postgres, "SELECT a -- why? because\nFROM t WHERE b = ?", "SELECT a -- why? because\nFROM t WHERE b = $1"},
		{"pg line comment at the end", Postgres, "SELECT ? -- ?", "SELECT $1 -- ?"},
		{"pg quote in a line comment", Postgres, "SELECT ? -- don't\n, ?", "SELECT $1 -- don't\n, $2"},
		{"pg block comment", Postgres, "SELECT /* ? */ ?", "SELECT /* ? */ $1"},
		{"pg nested block comment", Postgres, "SELECT /* a /* ? */ ? */ ?", "SELECT /* a /* ? */ ? */ $1"},
		{"pg E string", Postgres, `SELECT E'\'?' , ?`, `SELECT E'\'?' , $1`},
		{"pg e string, escaped backslash", Postgres, `SELECT e'a\\' , ?`, `SELECT e'a\\' , $1`},
		{"pg E string, doubled quote", Postgres, `SELECT E'a''?' , ?`, `SELECT E'a''?' , $1`},
		{"pg dollar quote", Postgres, "SELECT $$ ? ' $$, ?", "SELECT $$ ? ' $$, $1"},
		{"pg tagged dollar quote", Postgres, "SELECT $fn$ ? $$ ? $fn$, ?", "SELECT $fn$ ? $$ ? $fn$, $1"},
		{"pg identifier with a dollar", Postgres, "SELECT a$b$ FROM t WHERE c = ?", "SELECT a$b$ FROM t WHERE c = $1"},
		// Not literals: a name ending in e before a quote, a minus, a
		// division.
		{"pg name ending in e", Postgres, `SELECT name'\', ?`, `SELECT name'\', $1`},
		{"pg minus and division", Postgres, "SELECT ? - 1, ? / 2", "SELECT $1 - 1, $2 / 2"},
		// Unterminated: copied to the end (the database rejects it).
		{"pg unterminated literal", Postgres, "SELECT ?, '?", "SELECT $1, '?"},
		{"pg unterminated comment", Postgres, "SELECT ? /* ?", "SELECT $1 /* ?"},
		{"pg unterminated dollar quote", Postgres, "SELECT ?, $$ ?", "SELECT $1, $$ ?"},

		{"sqlite compute_now", SQLite, "UPDATE t SET at = compute_now(), b = compute_now() WHERE id = ?", "UPDATE t SET at = " + sqliteNow + ", b = " + sqliteNow + " WHERE id = ?"},
		{"sqlite no compute_now", SQLite, "SELECT a FROM t WHERE b = ?", "SELECT a FROM t WHERE b = ?"},
		// was wrong: compute_now() was replaced inside literals, identifiers
		// and comments (and sqliteNow's own quotes then broke the literal).
		{"sqlite compute_now in a literal", SQLite, "SELECT 'compute_now()', compute_now()", "SELECT 'compute_now()', " + sqliteNow},
		{"sqlite compute_now in an identifier", SQLite, `SELECT "compute_now()" FROM t`, `SELECT "compute_now()" FROM t`},
		{"sqlite compute_now in comments", SQLite, "SELECT 1 -- compute_now()\n/* compute_now() */", "SELECT 1 -- compute_now()\n/* compute_now() */"},
		{"sqlite comments do not nest", SQLite, "SELECT /* /* */ compute_now() */", "SELECT /* /* */ " + sqliteNow + " */"},
		{"sqlite longer name", SQLite, "SELECT recompute_now()", "SELECT recompute_now()"},
		// SQLite has neither E strings nor dollar quotes.
		{"sqlite backslash", SQLite, `SELECT E'\', compute_now()`, `SELECT E'\', ` + sqliteNow},
		{"sqlite dollar", SQLite, "SELECT $$, compute_now()", "SELECT $$, " + sqliteNow},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := rewriteSQL(c.dialect, c.in); got != c.want {
				t.Errorf("rewriteSQL(%s, %q)\n got %q\nwant %q", c.dialect, c.in, got, c.want)
			}
		})
	}
}

// The rewrite is made once per query text.
func TestRewriteCached(t *testing.T) {
	db := &DB{dialect: Postgres}
	q := "SELECT ? -- ?"
	first := db.rewrite(q)
	if v, ok := db.stmt.Load(q); !ok || v.(string) != first {
		t.Fatalf("rewrite of %q not cached: %v %v", q, v, ok)
	}
	if got := db.rewrite(q); got != "SELECT $1 -- ?" {
		t.Fatalf("rewrite(%q) = %q", q, got)
	}
}

func BenchmarkRewriteSQL(b *testing.B) {
	q := "UPDATE nodes SET identity_generation = 1, state = ?, state_reason = '', role = ?, hardware_key = ?, hardware_key_trusted = ?, " +
		"node_key = ?, attestor = ?, hostname = CASE WHEN ? = '' THEN hostname ELSE ? END, claims = ?, join_token_id = ?, updated_ms = compute_now() " +
		"WHERE id = ? AND state = 'pending' AND identity_generation = 0 RETURNING id, tenant_id, site_id, pool_id, role, state, state_reason, connection, last_seen_ms, identity_generation"
	for _, d := range []Dialect{Postgres, SQLite} {
		b.Run(string(d), func(b *testing.B) {
			for b.Loop() {
				rewriteSQL(d, q)
			}
		})
	}
}
