package engine

import (
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"reflect"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
)

// Row is the row Tx.QueryRow returns: database/sql's (*sql.Row) in a
// SQLite read transaction, one read straight from the driver on SQLite's
// writer (writerConn.queryRow), or a PostgreSQL query's, alone or the last
// of a batch (Tx.pgQueryRow). The typed methods only Scan it, once, as
// they would a *sql.Row.
type Row struct {
	sr   *sql.Row
	err  error          // the query failed
	vals []driver.Value // the raw row; nil with none
	none bool           // the raw query returned no row
	// pg is PostgreSQL's result and br its batch (nil for a query sent
	// alone), closed once scanned (or by the transaction's next
	// statement: Tx.settle).
	pg pgx.Rows
	br pgx.BatchResults
}

// Scan copies the row's columns into dest, as (*sql.Row).Scan does:
// sql.ErrNoRows when there was none.
func (r *Row) Scan(dest ...any) error {
	switch {
	case r.err != nil:
		return r.err
	case r.sr != nil:
		return r.sr.Scan(dest...)
	case r.pg != nil:
		return r.scanPG(dest)
	case r.none:
		return sql.ErrNoRows
	}
	if len(dest) != len(r.vals) {
		return fmt.Errorf("sql: expected %d destination arguments in Scan, not %d", len(r.vals), len(dest))
	}
	for i, d := range dest {
		if err := assign(d, r.vals[i]); err != nil {
			return fmt.Errorf("sql: Scan error on column index %d: %w", i, err)
		}
	}
	return nil
}

// scanPG scans the first row of a PostgreSQL query with pgx and closes it
// (and its batch).
func (r *Row) scanPG(dest []any) error {
	var err error
	if r.pg.Next() {
		err = r.pg.Scan(dest...)
	} else if err = r.pg.Err(); err == nil {
		err = sql.ErrNoRows
	}
	if cerr := r.close(); err == nil {
		err = cerr
	}
	r.err = err
	if r.err == nil {
		r.err = errScanned
	}
	return err
}

// errScanned is what scanning a batch's row a second time returns.
var errScanned = errors.New("sql: Scan called twice on one row")

// close releases a batch's row whether or not it was scanned.
func (r *Row) close() error {
	if r.pg == nil {
		return nil
	}
	r.pg.Close()
	err := r.pg.Err()
	if r.br != nil {
		if cerr := r.br.Close(); err == nil {
			err = cerr
		}
	}
	r.pg, r.br = nil, nil
	return err
}

// assign stores the driver's value src (int64, float64, bool, []byte,
// string, time.Time or nil: what modernc's SQLite returns) in dest, with
// database/sql's conversions (convertAssign) for the destinations this
// package scans into; others go the way database/sql goes, by kind.
func assign(dest any, src driver.Value) error {
	switch d := dest.(type) {
	case *string:
		switch s := src.(type) {
		case string:
			*d = s
			return nil
		case []byte:
			*d = string(s)
			return nil
		}
	case *int64:
		if s, ok := src.(int64); ok {
			*d = s
			return nil
		}
	case *int:
		if s, ok := src.(int64); ok && int64(int(s)) == s {
			*d = int(s)
			return nil
		}
	case *bool:
		if s, ok := src.(int64); ok && (s == 0 || s == 1) {
			*d = s == 1
			return nil
		}
	case *[]byte:
		switch s := src.(type) {
		case []byte:
			*d = append([]byte(nil), s...)
			return nil
		case string:
			*d = []byte(s)
			return nil
		case nil:
			*d = nil
			return nil
		}
	case *any:
		if s, ok := src.([]byte); ok {
			*d = append([]byte(nil), s...)
		} else {
			*d = src
		}
		return nil
	case sql.Scanner:
		return d.Scan(src)
	}
	return assignByKind(dest, src)
}

// assignByKind is assign for the rest: pointers to a pointer (NULL is
// nil), to named strings, integers, booleans and floats, and time.Time.
func assignByKind(dest any, src driver.Value) error {
	dv := reflect.ValueOf(dest)
	if dv.Kind() != reflect.Pointer || dv.IsNil() {
		return fmt.Errorf("destination not a pointer: %T", dest)
	}
	dv = dv.Elem()
	if src == nil {
		switch dv.Kind() {
		case reflect.Pointer, reflect.Interface, reflect.Slice, reflect.Map:
			dv.SetZero()
			return nil
		}
		return fmt.Errorf("converting NULL to %s is unsupported", dv.Kind())
	}
	if dv.Kind() == reflect.Pointer {
		p := reflect.New(dv.Type().Elem())
		if err := assign(p.Interface(), src); err != nil {
			return err
		}
		dv.Set(p)
		return nil
	}
	if t, ok := src.(time.Time); ok {
		if dv.Type() == reflect.TypeOf(t) {
			dv.Set(reflect.ValueOf(t))
			return nil
		}
		src = t.Format(time.RFC3339Nano)
	}
	s := asString(src)
	var err error
	switch dv.Kind() {
	case reflect.String:
		dv.SetString(s)
		return nil
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		var n int64
		if n, err = strconv.ParseInt(s, 10, dv.Type().Bits()); err == nil {
			dv.SetInt(n)
			return nil
		}
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		var n uint64
		if n, err = strconv.ParseUint(s, 10, dv.Type().Bits()); err == nil {
			dv.SetUint(n)
			return nil
		}
	case reflect.Float32, reflect.Float64:
		var f float64
		if f, err = strconv.ParseFloat(s, dv.Type().Bits()); err == nil {
			dv.SetFloat(f)
			return nil
		}
	case reflect.Bool:
		var b driver.Value
		if b, err = driver.Bool.ConvertValue(src); err == nil {
			dv.SetBool(b.(bool))
			return nil
		}
	default:
		return fmt.Errorf("unsupported Scan, storing driver.Value type %T into type %T", src, dest)
	}
	return fmt.Errorf("converting driver.Value type %T (%q) to a %s: %w", src, s, dv.Kind(), err)
}

// asString formats a driver value as database/sql does before parsing it.
func asString(src driver.Value) string {
	switch v := src.(type) {
	case string:
		return v
	case []byte:
		return string(v)
	case int64:
		return strconv.FormatInt(v, 10)
	case float64:
		return strconv.FormatFloat(v, 'g', -1, 64)
	case bool:
		return strconv.FormatBool(v)
	}
	return fmt.Sprintf("%v", src)
}

// namedValues converts a statement's arguments for the driver as
// database/sql does for a driver without its own checker (modernc's has
// none): driver values as they are, the rest through
// driver.DefaultParameterConverter (Valuers, named kinds, pointers).
func namedValues(args []any) ([]driver.NamedValue, error) {
	nv := make([]driver.NamedValue, len(args))
	for i, a := range args {
		switch a.(type) {
		case nil, int64, float64, bool, []byte, string, time.Time:
		case int:
			a = int64(a.(int))
		default:
			v, err := driver.DefaultParameterConverter.ConvertValue(a)
			if err != nil {
				return nil, fmt.Errorf("sql: converting argument $%d type: %w", i+1, err)
			}
			a = v
		}
		nv[i] = driver.NamedValue{Ordinal: i + 1, Value: a}
	}
	return nv, nil
}

// Rows is what Tx.Query returns: database/sql's *sql.Rows, or, on SQLite's
// writer, rawRows. Its caller reads and closes it as it would a *sql.Rows.
type Rows interface {
	Columns() ([]string, error)
	Next() bool
	Scan(dest ...any) error
	Err() error
	Close() error
}

// rawRows are a query's rows read straight from the driver on SQLite's
// writer (writerConn.query) and scanned as database/sql scans them
// (assign), like row for one row.
type rawRows struct {
	rows   driver.Rows
	vals   []driver.Value
	ok     bool // vals holds the current row
	err    error
	closed bool
}

// Next reads the next row, false at the end or on an error (Err); the
// rows are closed then, as database/sql closes them.
func (r *rawRows) Next() bool {
	if r.closed {
		return false
	}
	err := r.rows.Next(r.vals)
	if r.ok = err == nil; !r.ok {
		if err != io.EOF {
			r.err = err
		}
		if cerr := r.Close(); r.err == nil {
			r.err = cerr
		}
	}
	return r.ok
}

// Scan copies the current row's columns into dest.
func (r *rawRows) Scan(dest ...any) error {
	if r.closed || !r.ok {
		return errors.New("sql: Scan called without calling Next")
	}
	if len(dest) != len(r.vals) {
		return fmt.Errorf("sql: expected %d destination arguments in Scan, not %d", len(r.vals), len(dest))
	}
	for i, d := range dest {
		if err := assign(d, r.vals[i]); err != nil {
			return fmt.Errorf("sql: Scan error on column index %d, name %q: %w", i, r.rows.Columns()[i], err)
		}
	}
	return nil
}

// Columns names the rows' columns.
func (r *rawRows) Columns() ([]string, error) {
	if r.closed {
		return nil, errors.New("sql: Rows are closed")
	}
	return r.rows.Columns(), nil
}

// Err is the error that ended Next, nil at the end of the rows.
func (r *rawRows) Err() error { return r.err }

// Close releases the statement for the writer's next use of it; a second
// Close does nothing.
func (r *rawRows) Close() error {
	if r.closed {
		return nil
	}
	r.closed, r.ok = true, false
	return r.rows.Close()
}
