package store

import (
	"database/sql"
	"errors"
	"strings"
	"time"
)

// ErrNotFound is returned by single-row reads that find nothing.
var ErrNotFound = errors.New("not found")

func notFound(err error) error {
	if errors.Is(err, sql.ErrNoRows) {
		return ErrNotFound
	}
	return err
}

func ms(t time.Time) int64 { return t.UnixMilli() }

func fromMS(v int64) time.Time { return time.UnixMilli(v).UTC() }

func fromNullMS(v sql.NullInt64) *time.Time {
	if !v.Valid {
		return nil
	}
	t := fromMS(v.Int64)
	return &t
}

// nullBytes stores an empty byte slice as NULL.
func nullBytes(b []byte) any {
	if len(b) == 0 {
		return nil
	}
	return b
}

func qualify(alias, cols string) string {
	names := strings.Split(cols, ", ")
	for i, c := range names {
		names[i] = alias + "." + c
	}
	return strings.Join(names, ", ")
}
