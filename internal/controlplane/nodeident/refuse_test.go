package nodeident_test

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// refusalLine is a refusal's log line as the JSON handler writes it.
type refusalLine struct {
	Msg, Reason, Tenant, Peer string
	Suppressed                int
	Recorded                  bool
}

// R4.7, R15.4: refused joins write a bounded number of log lines. 4,000
// refusals of one tenant and reason in a minute are LogLinesPerMinute lines,
// each naming the peer; another reason has its own lines; once the clock
// moves past the window the next line says how many were suppressed.
func TestRefusalLogLinesBounded(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		err := db.WithTx(ctx, func(tx *store.Tx) error {
			tn, err := tx.InsertTenant(ctx, ids.New(ids.Tenant, time.Now()), "root-"+ids.New("x", time.Now()))
			if err != nil {
				return err
			}
			return tx.SetRootTenantID(ctx, tn.ID)
		})
		if err != nil {
			t.Fatal(err)
		}
		c := clock.NewFake(time.Now())
		var buf bytes.Buffer
		core, err := nodeident.New(nodeident.Config{DB: db, Clock: c, Hub: events.NewHub(), Log: slog.New(slog.NewJSONHandler(&buf, nil))})
		if err != nil {
			t.Fatal(err)
		}
		tests := []struct {
			name      string
			advance   time.Duration
			reason    string
			n         int
			lines     int
			lastPeer  string
			lastSuppr int
		}{
			{"a flood from one peer", 0, "token-unknown", 4000, nodeident.LogLinesPerMinute, "198.51.100.7:4000", 0},
			{"another reason, its own lines", 0, "token-expired", 3, 3, "198.51.100.7:4000", 0},
			{"the window ended: the count of the suppressed", time.Minute, "token-unknown", 1, 1, "198.51.100.7:4000", 4000 - nodeident.LogLinesPerMinute},
		}
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				c.Advance(tc.advance)
				buf.Reset()
				pctx := nodeident.WithPeer(ctx, tc.lastPeer)
				for range tc.n {
					core.Refused(pctx, nodeident.Refused{Kind: nodeident.KindJoin, Attestor: "join-token", Refusal: nodeident.Refuse(tc.reason, "")})
				}
				var got []refusalLine
				for _, s := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
					var l refusalLine
					if err := json.Unmarshal([]byte(s), &l); err != nil {
						t.Fatalf("line %q: %v", s, err)
					}
					got = append(got, l)
				}
				if len(got) != tc.lines {
					t.Fatalf("%d refusals wrote %d lines, want %d", tc.n, len(got), tc.lines)
				}
				last := got[len(got)-1]
				if last.Msg != "join refused" || last.Reason != "join-token:"+tc.reason || last.Peer != tc.lastPeer || last.Suppressed != tc.lastSuppr {
					t.Errorf("last line %+v, want join refused, reason join-token:%s, peer %s, suppressed %d", last, tc.reason, tc.lastPeer, tc.lastSuppr)
				}
			})
		}
	})
}
