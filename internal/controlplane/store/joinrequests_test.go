package store_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// newRequest is a pending request of machine key in the pool.
func newRequest(pl store.Pool, machineKey, csr string) store.JoinRequest {
	return store.JoinRequest{ID: ids.New(ids.JoinRequest, time.Now()), TenantID: pl.OwnerTenantID, PoolID: pl.ID, SiteID: pl.SiteID,
		Attestor: "discovery", Role: "ramdisk", MachineKey: machineKey, Claims: []byte(`{"serial":"S1"}`),
		MAC: "52:54:00:12:34:56", IP: "10.0.0.7", WorkflowID: "wf-1", VouchedBy: "node_site", BootLeaseEpoch: 3, CSRSHA256: digestOf(csr)}
}

func withTx[T any](t *testing.T, db *store.DB, fn func(tx *store.Tx) (T, error)) (T, error) {
	t.Helper()
	var out T
	err := db.WithTx(context.Background(), func(tx *store.Tx) error {
		var err error
		out, err = fn(tx)
		return err
	})
	return out, err
}

func mustTx[T any](t *testing.T, db *store.DB, fn func(tx *store.Tx) (T, error)) T {
	t.Helper()
	out, err := withTx(t, db, fn)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// R10.2: a machine has at most one open request, in its tenant; a newer
// attempt refreshes it (new CSR, back to pending, decision cleared); a
// closed request makes room for a new one; lookups by CSR find the newest.
func TestJoinRequestOpenPerMachine(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		_, _, pl := fixture(t, db)
		_, _, other := fixture(t, db)

		r1 := newRequest(pl, "mk-1", "csr-a")
		got := mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) { return tx.InsertJoinRequest(ctx, r1) })
		if got.ID != r1.ID || got.State != store.JoinRequestPending || got.MachineKey != "mk-1" || string(got.Claims) != `{"serial":"S1"}` ||
			got.HardwareKey != nil || got.EKHash != nil || got.MAC != r1.MAC || got.IP != r1.IP || got.WorkflowID != "wf-1" ||
			got.VouchedBy != "node_site" || got.BootLeaseEpoch != 3 || !bytes.Equal(got.CSRSHA256, r1.CSRSHA256) ||
			got.DecidedAt != nil || got.ApprovedUntil != nil || got.ConsumedAt != nil || got.NodeID != "" {
			t.Fatalf("inserted %+v", got)
		}
		if d := time.Since(got.CreatedAt); d > time.Minute || d < -time.Minute || !got.UpdatedAt.Equal(got.CreatedAt) {
			t.Fatalf("created %s updated %s: not compute_now()", got.CreatedAt, got.UpdatedAt)
		}

		// A second open request of the machine: a unique violation.
		_, err := withTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) {
			return tx.InsertJoinRequest(ctx, newRequest(pl, "mk-1", "csr-b"))
		})
		if !store.IsUniqueViolation(err) {
			t.Fatalf("second open request: %v, want a unique violation", err)
		}
		// The same machine key in another tenant is another machine.
		mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) {
			return tx.InsertJoinRequest(ctx, newRequest(other, "mk-1", "csr-a"))
		})

		open := mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) {
			return tx.OpenJoinRequest(ctx, pl.OwnerTenantID, "mk-1")
		})
		if open.ID != r1.ID {
			t.Fatalf("open request %s, want %s", open.ID, r1.ID)
		}
		if _, err := withTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) {
			return tx.OpenJoinRequest(ctx, pl.OwnerTenantID, "mk-2")
		}); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("no open request: %v", err)
		}

		// Approve, then a newer attempt refreshes: pending again with the
		// new CSR and facts, the decision cleared.
		at := time.Now().Truncate(time.Millisecond).UTC()
		until := at.Add(15 * time.Minute)
		mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) {
			return tx.DecideJoinRequest(ctx, r1.ID, store.JoinRequestApproved, "prn_alice", "known rack", "", at, &until)
		})
		fresh := newRequest(pl, "mk-1", "csr-b")
		fresh.ID, fresh.HardwareKey, fresh.EKHash, fresh.BootLeaseEpoch, fresh.Attestor = r1.ID, []byte{1, 2}, []byte{3, 4}, 4, "tpm"
		ref := mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) { return tx.RefreshJoinRequest(ctx, fresh) })
		if ref.State != store.JoinRequestPending || ref.DecidedAt != nil || ref.DecidedBy != "" || ref.Reason != "" || ref.ApprovedUntil != nil ||
			!bytes.Equal(ref.CSRSHA256, digestOf("csr-b")) || !bytes.Equal(ref.HardwareKey, []byte{1, 2}) || !bytes.Equal(ref.EKHash, []byte{3, 4}) ||
			ref.BootLeaseEpoch != 4 || ref.Attestor != "tpm" || !ref.CreatedAt.Equal(got.CreatedAt) {
			t.Fatalf("refreshed %+v", ref)
		}
		byCSR := mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) {
			return tx.JoinRequestByCSR(ctx, pl.OwnerTenantID, digestOf("csr-b"))
		})
		if byCSR.ID != r1.ID {
			t.Fatalf("by CSR %s, want %s", byCSR.ID, r1.ID)
		}
		if _, err := withTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) {
			return tx.JoinRequestByCSR(ctx, pl.OwnerTenantID, digestOf("csr-a"))
		}); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("by the replaced CSR: %v", err)
		}

		// Rejected: closed. Refresh refuses it; a new request of the
		// machine may be inserted, and is the newest by CSR.
		mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) {
			return tx.DecideJoinRequest(ctx, r1.ID, store.JoinRequestRejected, "prn_alice", "not ours", "", at, nil)
		})
		if _, err := withTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) { return tx.RefreshJoinRequest(ctx, fresh) }); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("refresh a rejected request: %v", err)
		}
		again := newRequest(pl, "mk-1", "csr-b")
		mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) { return tx.InsertJoinRequest(ctx, again) })
		byCSR = mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) {
			return tx.JoinRequestByCSR(ctx, pl.OwnerTenantID, digestOf("csr-b"))
		})
		if byCSR.ID != again.ID {
			t.Fatalf("newest by CSR %s, want %s", byCSR.ID, again.ID)
		}
		if _, err := withTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) {
			return tx.JoinRequestByCSR(ctx, other.OwnerTenantID, digestOf("csr-b"))
		}); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("by CSR across tenants: %v", err)
		}
	})
}

// R10.3: only a pending request is decided; an approval is consumed once,
// before it runs out, and names the node; an approval that ran out is
// stored as expired.
func TestJoinRequestDecideConsumeExpire(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		_, _, pl := fixture(t, db)
		at := time.Now().Truncate(time.Millisecond).UTC()
		until := at.Add(10 * time.Minute)
		r := mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) {
			return tx.InsertJoinRequest(ctx, newRequest(pl, "mk-1", "c1"))
		})
		decide := func(id, state string, until *time.Time) (store.JoinRequest, error) {
			return withTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) {
				return tx.DecideJoinRequest(ctx, id, state, "prn_bob", "reason "+state, "", at, until)
			})
		}
		consume := func(id, node string, at time.Time) error {
			return db.WithTx(ctx, func(tx *store.Tx) error { return tx.ConsumeJoinRequest(ctx, id, node, at) })
		}
		// Nothing approved yet: nothing to consume.
		if err := consume(r.ID, "node_1", at); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("consume pending: %v", err)
		}
		// Bad decisions are refused before touching anything.
		for _, c := range []struct {
			state string
			until *time.Time
		}{{store.JoinRequestApproved, nil}, {store.JoinRequestRejected, &until}, {store.JoinRequestConsumed, nil}} {
			if _, err := decide(r.ID, c.state, c.until); err == nil || errors.Is(err, store.ErrNotFound) {
				t.Fatalf("decide %s %v: %v, want a refusal", c.state, c.until, err)
			}
		}
		if _, err := decide("jreq_absent", store.JoinRequestRejected, nil); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("decide absent: %v", err)
		}
		ok, err := decide(r.ID, store.JoinRequestApproved, &until)
		if err != nil {
			t.Fatal(err)
		}
		if ok.State != store.JoinRequestApproved || ok.DecidedAt == nil || !ok.DecidedAt.Equal(at) || ok.DecidedBy != "prn_bob" ||
			ok.Reason != "reason approved" || ok.ApprovedUntil == nil || !ok.ApprovedUntil.Equal(until) || !ok.UpdatedAt.Equal(at) {
			t.Fatalf("approved %+v", ok)
		}
		// Deciding twice: not pending any more.
		if _, err := decide(r.ID, store.JoinRequestRejected, nil); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("decide twice: %v", err)
		}
		// The approval ends at approved_until, exclusive.
		if err := consume(r.ID, "node_1", until); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("consume at the end of the approval: %v", err)
		}
		if err := consume(r.ID, "node_1", at.Add(time.Minute)); err != nil {
			t.Fatal(err)
		}
		if err := consume(r.ID, "node_2", at.Add(2*time.Minute)); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("consume twice: %v", err)
		}
		got := mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) { return tx.GetJoinRequest(ctx, r.ID) })
		if got.State != store.JoinRequestConsumed || got.NodeID != "node_1" || got.ConsumedAt == nil || !got.ConsumedAt.Equal(at.Add(time.Minute)) {
			t.Fatalf("consumed %+v", got)
		}
		// Consumed is closed: expiring leaves it, and the machine may ask anew.
		if err := db.WithTx(ctx, func(tx *store.Tx) error { return tx.ExpireJoinRequest(ctx, r.ID, at) }); err != nil {
			t.Fatal(err)
		}
		if got := mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) { return tx.GetJoinRequest(ctx, r.ID) }); got.State != store.JoinRequestConsumed {
			t.Fatalf("expire a consumed request: %s", got.State)
		}
		r2 := mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) {
			return tx.InsertJoinRequest(ctx, newRequest(pl, "mk-1", "c2"))
		})

		// An approval that runs out unused: expired, not consumable.
		if _, err := decide(r2.ID, store.JoinRequestApproved, &until); err != nil {
			t.Fatal(err)
		}
		if err := db.WithTx(ctx, func(tx *store.Tx) error { return tx.ExpireJoinRequest(ctx, r2.ID, until) }); err != nil {
			t.Fatal(err)
		}
		got = mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) { return tx.GetJoinRequest(ctx, r2.ID) })
		if got.State != store.JoinRequestExpired || !got.UpdatedAt.Equal(until) {
			t.Fatalf("expired %+v", got)
		}
		if err := consume(r2.ID, "node_1", at); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("consume expired: %v", err)
		}
		if _, err := withTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) { return tx.GetJoinRequest(ctx, "jreq_absent") }); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("get absent: %v", err)
		}
	})
}

// R10.3: an approval admits exactly one join, however many race for it.
func TestJoinRequestConsumeRace(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		_, _, pl := fixture(t, db)
		at := time.Now().UTC()
		until := at.Add(time.Hour)
		r := mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) {
			return tx.InsertJoinRequest(ctx, newRequest(pl, "mk", "c"))
		})
		mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) {
			return tx.DecideJoinRequest(ctx, r.ID, store.JoinRequestApproved, "prn_bob", "ok", "", at, &until)
		})
		const n = 50
		var wg sync.WaitGroup
		results := make([]error, n)
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				results[i] = db.WithTx(ctx, func(tx *store.Tx) error { return tx.ConsumeJoinRequest(ctx, r.ID, fmt.Sprintf("node_%d", i), at) })
			}()
		}
		wg.Wait()
		winner := -1
		for i, err := range results {
			switch {
			case err == nil && winner >= 0:
				t.Fatalf("consumers %d and %d both won", winner, i)
			case err == nil:
				winner = i
			case !errors.Is(err, store.ErrNotFound):
				t.Fatalf("consumer %d: %v", i, err)
			}
		}
		if winner < 0 {
			t.Fatal("no consumer won")
		}
		got := mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) { return tx.GetJoinRequest(ctx, r.ID) })
		if got.NodeID != fmt.Sprintf("node_%d", winner) {
			t.Fatalf("consumed by %s, winner was %d", got.NodeID, winner)
		}
	})
}

// R10.1: listing is per tenant and pool, by state, in id order with a
// cursor.
func TestListJoinRequests(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		_, _, pl := fixture(t, db)
		_, _, other := fixture(t, db)
		at := time.Now().UTC()
		var all []string
		for i := range 5 {
			r := mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) {
				return tx.InsertJoinRequest(ctx, newRequest(pl, fmt.Sprintf("mk-%d", i), fmt.Sprintf("c%d", i)))
			})
			all = append(all, r.ID)
		}
		slices.Sort(all) // ids of one millisecond sort randomly
		mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) {
			return tx.InsertJoinRequest(ctx, newRequest(other, "mk-0", "x"))
		})
		mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) {
			return tx.DecideJoinRequest(ctx, all[1], store.JoinRequestRejected, "prn", "no", "", at, nil)
		})
		list := func(pool store.Pool, states []string, after string, limit int) []string {
			rs := mustTx(t, db, func(tx *store.Tx) ([]store.JoinRequest, error) {
				return tx.ListJoinRequests(ctx, pool.OwnerTenantID, pool.ID, states, after, limit)
			})
			var out []string
			for _, r := range rs {
				out = append(out, r.ID)
			}
			return out
		}
		eq := func(got, want []string) {
			t.Helper()
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("listed %v, want %v", got, want)
			}
		}
		eq(list(pl, nil, "", 100), all)
		eq(list(pl, []string{store.JoinRequestPending}, "", 100), []string{all[0], all[2], all[3], all[4]})
		eq(list(pl, []string{store.JoinRequestRejected, store.JoinRequestApproved}, "", 100), []string{all[1]})
		eq(list(pl, []string{}, "", 100), nil)
		eq(list(pl, nil, "", 2), all[:2])
		eq(list(pl, nil, all[1], 2), all[2:4])
		eq(list(pl, nil, all[4], 2), nil)
		// Another tenant's pool id under this tenant: nothing.
		eq(list(store.Pool{ID: other.ID, OwnerTenantID: pl.OwnerTenantID}, nil, "", 100), nil)
	})
}

// R10.4: a site's vouch for a MAC keeps the newest lease epoch; an older
// one changes nothing; each site's vouch is its own.
func TestSiteVouches(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		upsert := func(v store.SiteVouch) bool {
			return mustTx(t, db, func(tx *store.Tx) (bool, error) { return tx.UpsertSiteVouch(ctx, v) })
		}
		byMAC := func(tenant, mac string) []store.SiteVouch {
			return mustTx(t, db, func(tx *store.Tx) ([]store.SiteVouch, error) { return tx.SiteVouchesByMAC(ctx, tenant, mac) })
		}
		const mac = "52:54:00:aa:bb:cc"
		v := store.SiteVouch{TenantID: "tn_a", SiteID: "site_1", MAC: mac, IP: "10.0.0.5", LeaseEpoch: 5, VouchedBy: "node_s1", WorkflowID: "wf-5"}
		if !upsert(v) {
			t.Fatal("first vouch not recorded")
		}
		older := v
		older.LeaseEpoch, older.IP, older.VouchedBy = 4, "10.0.0.99", "node_evil"
		if upsert(older) {
			t.Fatal("an older lease epoch was recorded")
		}
		same := v
		same.IP = "10.0.0.6"
		if !upsert(same) {
			t.Fatal("the same epoch anew not recorded")
		}
		newer := same
		newer.LeaseEpoch, newer.WorkflowID = 6, "wf-6"
		if !upsert(newer) {
			t.Fatal("a newer epoch not recorded")
		}
		other := v
		other.SiteID, other.LeaseEpoch, other.VouchedBy = "site_2", 1, "node_s2"
		if !upsert(other) {
			t.Fatal("another site's vouch not recorded")
		}
		upsert(store.SiteVouch{TenantID: "tn_b", SiteID: "site_1", MAC: mac, LeaseEpoch: 9, VouchedBy: "node_b"})
		got := byMAC("tn_a", mac)
		if len(got) != 2 {
			t.Fatalf("vouches %+v", got)
		}
		g := got[0]
		if g.SiteID != "site_1" || g.LeaseEpoch != 6 || g.IP != "10.0.0.6" || g.VouchedBy != "node_s1" || g.WorkflowID != "wf-6" {
			t.Fatalf("site_1 vouch %+v", g)
		}
		if d := time.Since(g.UpdatedAt); d > time.Minute || d < -time.Minute {
			t.Fatalf("updated %s: not compute_now()", g.UpdatedAt)
		}
		if got[1].SiteID != "site_2" || got[1].LeaseEpoch != 1 {
			t.Fatalf("site_2 vouch %+v", got[1])
		}
		if got := byMAC("tn_a", "52:54:00:00:00:00"); len(got) != 0 {
			t.Fatalf("unknown MAC: %+v", got)
		}
	})
}

// R22.1, R22.2: a request keeps the attestor's evidence and its effect
// through insert and refresh; an approval keeps the node it acknowledged,
// and a refresh clears it; the open requests of one hardware key are
// listed per pool, closed ones left out.
func TestJoinRequestEvidenceAndEffect(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		_, _, pl := fixture(t, db)
		r := newRequest(pl, "ek:01", "csr-a")
		r.Attestor, r.HardwareKey, r.EKHash, r.AKName = "tpm", []byte{0x77}, []byte{1}, []byte{0, 0xb, 2}
		r.EKCert, r.EKCertSubject, r.EKCertIssuer, r.Source = store.EKCertUntrusted, "CN=ek", "CN=ca", "192.0.2.9"
		r.Effect, r.EffectNodeID = store.JoinEffectReclaim, "node_v"
		got := mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) { return tx.InsertJoinRequest(ctx, r) })
		if got.EKCert != store.EKCertUntrusted || got.EKCertSubject != "CN=ek" || got.EKCertIssuer != "CN=ca" || !bytes.Equal(got.AKName, r.AKName) ||
			got.Effect != store.JoinEffectReclaim || got.EffectNodeID != "node_v" || got.AcknowledgedNodeID != "" {
			t.Fatalf("inserted %+v", got)
		}
		until := time.Now().Add(time.Hour)
		got = mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) {
			return tx.DecideJoinRequest(ctx, r.ID, store.JoinRequestApproved, "prn", "ok", "node_v", time.Now(), &until)
		})
		if got.AcknowledgedNodeID != "node_v" {
			t.Fatalf("approved %+v: want the acknowledged node", got)
		}
		r.CSRSHA256, r.Effect, r.EffectNodeID, r.EKCert, r.AKName = digestOf("csr-b"), store.JoinEffectNew, "", store.EKCertAbsent, nil
		got = mustTx(t, db, func(tx *store.Tx) (store.JoinRequest, error) { return tx.RefreshJoinRequest(ctx, r) })
		if got.State != store.JoinRequestPending || got.AcknowledgedNodeID != "" || got.Effect != store.JoinEffectNew || got.EffectNodeID != "" ||
			got.EKCert != store.EKCertAbsent || got.AKName != nil {
			t.Fatalf("refreshed %+v", got)
		}
		// Two more of the same key: one in the pool, one closed; and one
		// in another pool of the tenant.
		same := newRequest(pl, "ek:02", "csr-c")
		same.HardwareKey = []byte{0x77}
		closed := newRequest(pl, "ek:03", "csr-d")
		closed.HardwareKey = []byte{0x77}
		pl2 := mustTx(t, db, func(tx *store.Tx) (store.Pool, error) {
			return tx.InsertPool(ctx, store.Pool{ID: ids.New(ids.Pool, time.Now()), SiteID: pl.SiteID, OwnerTenantID: pl.OwnerTenantID, Name: "cpu",
				Agent: "bcd", Policy: []byte(`{}`)})
		})
		elsewhere := newRequest(pl2, "ek:04", "csr-e")
		elsewhere.HardwareKey = []byte{0x77}
		mustTx(t, db, func(tx *store.Tx) (int, error) {
			for _, x := range []store.JoinRequest{same, closed, elsewhere} {
				if _, err := tx.InsertJoinRequest(ctx, x); err != nil {
					return 0, err
				}
			}
			_, err := tx.DecideJoinRequest(ctx, closed.ID, store.JoinRequestRejected, "prn", "no", "", time.Now(), nil)
			return 0, err
		})
		open := mustTx(t, db, func(tx *store.Tx) ([]store.JoinRequest, error) {
			return tx.OpenJoinRequestsByHardwareKey(ctx, pl.OwnerTenantID, pl.ID, []byte{0x77}, 10)
		})
		var ids []string
		for _, o := range open {
			ids = append(ids, o.ID)
		}
		if want := []string{r.ID, same.ID}; !slices.Equal(ids, want) {
			t.Fatalf("open requests of the key: %v, want %v", ids, want)
		}
	})
}
