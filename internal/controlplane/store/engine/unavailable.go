package engine

import (
	"database/sql"
	"database/sql/driver"
	"errors"
	"io"
	"net"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
	"modernc.org/sqlite"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// Why a store cannot take a statement now, as UnavailableReason names it.
const (
	UnavailableUnreachable = "unreachable"
	UnavailableReadOnly    = "read-only"
	UnavailableFull        = "out of space"
)

// SQLite's primary result codes a full, read-only or failing disk gives.
const (
	sqliteReadOnly = 8
	sqliteIOErr    = 10
	sqliteFull     = 13
	sqliteCantOpen = 14
)

// UnavailableReason says why err means the database cannot take work
// right now (it is unreachable or restarting, read-only, or out of space),
// "" when it does not. Such a failure is the caller's to retry, never an
// internal error (R19.1).
func UnavailableReason(err error) string {
	if err == nil {
		return ""
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		switch {
		case strings.HasPrefix(pe.Code, "08"), pe.Code == "57P01", pe.Code == "57P02", pe.Code == "57P03", pe.Code == "53300":
			// Connection exceptions, an administrator or crash shutdown, a
			// server still starting, too many connections.
			return UnavailableUnreachable
		case pe.Code == "25006":
			return UnavailableReadOnly
		case pe.Code == "53100":
			return UnavailableFull
		}
		return ""
	}
	var se *sqlite.Error
	if errors.As(err, &se) {
		switch se.Code() & 0xff {
		case sqliteFull:
			return UnavailableFull
		case sqliteReadOnly:
			return UnavailableReadOnly
		case sqliteIOErr, sqliteCantOpen:
			return UnavailableUnreachable
		}
		return ""
	}
	var ce *pgconn.ConnectError
	var ne net.Error
	switch {
	case errors.Is(err, ErrClosed), strings.Contains(err.Error(), "sql: database is closed"):
		// database/sql's own error for a closed handle (unexported): the
		// process is stopping; another replica, or this one restarted,
		// takes the retry.
		return UnavailableUnreachable
	case errors.As(err, &ce), errors.As(err, &ne),
		errors.Is(err, driver.ErrBadConn), errors.Is(err, sql.ErrConnDone),
		errors.Is(err, io.ErrUnexpectedEOF), pgconn.SafeToRetry(err),
		// A pooled connection the server or the network closed under
		// it: pgx says only "conn closed" (not SafeToRetry) on the first
		// use after it, e.g. at BEGIN. A COMMIT never gets here with it
		// unwrapped (commit wraps ErrCommitUnknown).
		errors.Is(err, pgconn.ErrConnClosed):
		return UnavailableUnreachable
	}
	return ""
}

// Unavailable turns a failure of the database itself into UNAVAILABLE,
// keeping it as the cause; any other error (a product error, a refusal, a
// constraint) is returned as it is.
func Unavailable(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := errs.As(err); ok {
		return err
	}
	if errors.Is(err, ErrCommitUnknown) {
		// It may have landed: "retry" would be advice to apply it twice.
		return err
	}
	if reason := UnavailableReason(err); reason != "" {
		return errs.Wrap(err, errs.Unavailable, "the database is %s; retry shortly", reason)
	}
	return err
}
