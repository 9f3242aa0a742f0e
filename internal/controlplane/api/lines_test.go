package api_test

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/api"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/wire/wiretest"
)

// R15.4: with the store down (closed here), unauthenticated requests (an operator
// call whose key cannot be looked up, /readyz) write LinesPerMinute lines
// per kind per minute, not one each; once the clock moves past the window
// the next line says how many were suppressed.
func TestStoreDownLinesBounded(t *testing.T) {
	db := storetest.OpenSQLite(t)
	c := clock.NewFake(time.Now())
	var logs wiretest.LogBuffer
	e := apitest.Start(t, db, apitest.Options{NoJoin: true, Clock: c, Log: slog.New(slog.NewJSONHandler(&logs, nil))})
	db.Close()
	key := "bck_key_01k5w0000000000000000000aa." + strings.Repeat("A", 43)
	const flood = 30
	tests := []struct {
		name, msg string
		do        func(t *testing.T) string
	}{
		{"operator calls", "authenticate an operator call", func(t *testing.T) string {
			return wiretest.RawCall{Protocol: "connect", Key: key, Body: []byte(`{}`)}.Do(t, e.HTTP.Client(), e.URL)
		}},
		{"readiness", "not ready", func(t *testing.T) string {
			res, err := e.HTTP.Client().Get(e.URL + "/readyz")
			if err != nil {
				t.Fatal(err)
			}
			res.Body.Close()
			return res.Status
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for range flood {
				if got := tc.do(t); got == "200 OK" {
					t.Fatalf("answered %s with the store closed", got)
				}
			}
			if got := logs.Lines(t, tc.msg, nil); len(got) != api.LinesPerMinute {
				t.Fatalf("%d requests wrote %d lines, want %d", flood, len(got), api.LinesPerMinute)
			}
			c.Advance(time.Minute)
			tc.do(t)
			got := logs.Lines(t, tc.msg, nil)
			if last := got[len(got)-1]; len(got) != api.LinesPerMinute+1 || last["suppressed"] != float64(flood-api.LinesPerMinute) {
				t.Errorf("after the window: %d lines, the last %v; want %d, suppressed %d", len(got), last, api.LinesPerMinute+1, flood-api.LinesPerMinute)
			}
			if n := len(logs.Lines(t, "internal error", nil)); n != 0 {
				t.Errorf("%d unlimited internal error lines", n)
			}
		})
	}
}
