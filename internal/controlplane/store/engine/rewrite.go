package engine

import (
	"strconv"
	"strings"
)

// sqliteNow is compute_now() on SQLite: wall time in milliseconds plus the
// test offset.
const sqliteNow = "(CAST(unixepoch('subsec') * 1000 AS INTEGER) + (SELECT offset_ms FROM compute_clock WHERE id = 1))"

// computeNow is the call the one SQL text reads the database's clock with.
const computeNow = "compute_now()"

// rewrite turns the one SQL text into the dialect's, caching the result.
func (db *DB) rewrite(q string) string {
	if v, ok := db.stmt.Load(q); ok {
		return v.(string)
	}
	out := rewriteSQL(db.dialect, q)
	db.stmt.Store(q, out)
	return out
}

// rewriteSQL turns the one SQL text q into dialect d's: on PostgreSQL each
// ? placeholder becomes $1, $2, …; on SQLite each compute_now() becomes
// sqliteNow (PostgreSQL has compute_now() as a function). Only SQL proper
// is rewritten: string literals, quoted identifiers and comments are copied
// as they are, so a '?' in a literal is not taken for a placeholder (it
// would shift every later one and leave the statement one argument short).
// Still, every ? outside them is a placeholder, so PostgreSQL's jsonb ?, ?|
// and ?& operators cannot be written, and SQLite's [name] and `name`
// identifiers are not recognised (the code base uses none of them).
//
// It runs once per distinct query text (rewrite caches it), and a text with
// nothing to rewrite is returned as it is.
func rewriteSQL(d Dialect, q string) string {
	switch d {
	case Postgres:
		if strings.IndexByte(q, '?') < 0 {
			return q
		}
	case SQLite:
		if !strings.Contains(q, computeNow) {
			return q
		}
	default:
		return q
	}
	var b strings.Builder
	b.Grow(len(q) + len(sqliteNow))
	n, done := 0, 0 // done: q[:done] is written to b
	for i := 0; i < len(q); {
		switch q[i] {
		case '\'', '"', '-', '/':
			if j := skipQuoted(d, q, i); j > i {
				i = j
				continue
			}
		case 'E', 'e', '$':
			if d == Postgres {
				if j := skipQuoted(d, q, i); j > i {
					i = j
					continue
				}
			}
		case '?':
			if d == Postgres {
				b.WriteString(q[done:i])
				n++
				b.WriteByte('$')
				b.WriteString(strconv.Itoa(n))
				i++
				done = i
				continue
			}
		case 'c':
			if d == SQLite && strings.HasPrefix(q[i:], computeNow) && (i == 0 || !identByte(q[i-1])) {
				b.WriteString(q[done:i])
				b.WriteString(sqliteNow)
				i += len(computeNow)
				done = i
				continue
			}
		}
		i++
	}
	b.WriteString(q[done:])
	return b.String()
}

// skipQuoted returns the end of the string literal, quoted identifier or
// comment that starts at q[i], or i when none does. An unterminated one runs
// to the end of q (the database rejects the statement).
//
// Both dialects: '…' and "…", where a doubled quote is a quote of the body;
// -- to the end of the line; /* … */. PostgreSQL only: E'…' with backslash escapes,
// dollar quotes ($$…$$, $tag$…$tag$), and nested /* … */ comments.
func skipQuoted(d Dialect, q string, i int) int {
	pg := d == Postgres
	switch c := q[i]; {
	case c == '\'' || c == '"':
		return skipDoubled(q, i+1, c)
	case c == '-' && strings.HasPrefix(q[i:], "--"):
		if j := strings.IndexByte(q[i:], '\n'); j >= 0 {
			return i + j + 1
		}
		return len(q)
	case c == '/' && strings.HasPrefix(q[i:], "/*"):
		return skipBlockComment(q, i, pg)
	case pg && (c == 'E' || c == 'e') && strings.HasPrefix(q[i+1:], "'") && (i == 0 || !identByte(q[i-1])):
		return skipEscaped(q, i+2)
	case pg && c == '$' && (i == 0 || !identByte(q[i-1])):
		return skipDollarQuoted(q, i)
	}
	return i
}

// skipDoubled returns the end of a literal quoted by quote whose body starts
// at q[i]: two quotes in a row are one quote of the body.
func skipDoubled(q string, i int, quote byte) int {
	for {
		j := strings.IndexByte(q[i:], quote)
		if j < 0 {
			return len(q)
		}
		i += j + 1
		if i < len(q) && q[i] == quote {
			i++
			continue
		}
		return i
	}
}

// skipEscaped returns the end of a PostgreSQL E'…' string whose body starts
// at q[i]: a backslash escapes the next byte, and a doubled quote is a quote.
func skipEscaped(q string, i int) int {
	for i < len(q) {
		switch q[i] {
		case '\\':
			i += 2
		case '\'':
			if i+1 < len(q) && q[i+1] == '\'' {
				i += 2
				continue
			}
			return i + 1
		default:
			i++
		}
	}
	return len(q)
}

// skipBlockComment returns the end of the /* … */ comment at q[i]. Only
// PostgreSQL nests them; SQLite ends a comment at the first */.
func skipBlockComment(q string, i int, nested bool) int {
	depth := 0
	for i < len(q) {
		switch {
		case strings.HasPrefix(q[i:], "/*") && (nested || depth == 0):
			depth++
			i += 2
		case strings.HasPrefix(q[i:], "*/"):
			depth--
			i += 2
			if depth == 0 {
				return i
			}
		default:
			i++
		}
	}
	return len(q)
}

// skipDollarQuoted returns the end of the PostgreSQL dollar-quoted string
// ($$…$$ or $tag$…$tag$) at q[i], or i when q[i] starts none (a $1
// parameter: a tag cannot start with a digit).
func skipDollarQuoted(q string, i int) int {
	k := i + 1
	if k < len(q) && q[k] != '$' {
		if !identStart(q[k]) {
			return i
		}
		for k < len(q) && identByte(q[k]) && q[k] != '$' {
			k++
		}
	}
	if k >= len(q) || q[k] != '$' {
		return i
	}
	tag := q[i : k+1]
	if j := strings.Index(q[k+1:], tag); j >= 0 {
		return k + 1 + j + len(tag)
	}
	return len(q)
}

// identStart reports whether c may start an unquoted identifier (bytes of
// multi-byte UTF-8 letters included).
func identStart(c byte) bool {
	return c == '_' || 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || c >= 0x80
}

// identByte reports whether c may continue an unquoted identifier
// (PostgreSQL allows $ after the first byte).
func identByte(c byte) bool {
	return identStart(c) || '0' <= c && c <= '9' || c == '$'
}
