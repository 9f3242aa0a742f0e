package enroll

import (
	"context"
	"crypto"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/checks/enrolltest"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

func digestOf(r *agentv1.JoinRequest) string { return hex.EncodeToString(pki.JoinRequestDigest(r)) }

func (e *env) pendingPath() string { return filepath.Join(e.cfg.DataDir, PendingFile) }

// noPending fails when join.pending exists.
func noPending(t *testing.T, e *env) {
	t.Helper()
	if _, err := os.Lstat(e.pendingPath()); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("R4.9: %s is still there (%v)", PendingFile, err)
	}
}

// csrKey is the key a request's CSR certifies.
func csrKey(t *testing.T, r *agentv1.JoinRequest) crypto.PublicKey {
	t.Helper()
	k, err := pki.ParseCSR(r.GetCsr())
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func hasProgress(e *env, sub string) bool {
	for _, l := range e.progress {
		if strings.Contains(l, sub) {
			return true
		}
	}
	return false
}

// R4.9: a join whose answer is lost after it landed (the gateway's upstream
// failed, the connection was reset, the daemon's deadline passed) is sent
// again, the very same request under a fresh seal, and gets the answer the
// control plane stored: one admission, the identity of the first request.
func TestJoinRetriesLostAnswerR4_9(t *testing.T) {
	tests := []struct {
		name        string
		loss        enrolltest.Loss
		callTimeout time.Duration
	}{
		{name: "HTTP 502", loss: enrolltest.Loss{Status: 502}},
		{name: "HTTP 503", loss: enrolltest.Loss{Status: 503}},
		{name: "HTTP 504", loss: enrolltest.Loss{Status: 504}},
		{name: "connection reset", loss: enrolltest.Loss{Reset: true}},
		{name: "deadline exceeded", loss: enrolltest.Loss{Hang: true}, callTimeout: 500 * time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t, envOption{})
			e.callTimeout = tt.callTimeout
			e.fake.LoseAnswers(tt.loss)
			id, err := e.joiner(e.cfg).Join(context.Background(), e.opts())
			if err != nil {
				t.Fatalf("R4.9: %v", err)
			}
			reqs := e.fake.Requests()
			if len(reqs) != 2 || e.fake.Admissions() != 1 {
				t.Fatalf("R4.9: %d requests, %d admissions; want 2 and 1", len(reqs), e.fake.Admissions())
			}
			if digestOf(reqs[0]) != digestOf(reqs[1]) {
				t.Fatal("R4.9: the retry is another request")
			}
			// A fresh seal, for the moved clock, still for this request.
			if _, err := ca.Open(e.bundle.JoinEncryptionKey, reqs[1].GetSealedToken(), reqs[1].GetCsr(), pki.JoinRequestDigest(reqs[1]), e.clock.Now()); err != nil {
				t.Fatalf("R4.2: the retry's seal: %v", err)
			}
			if !publicKeyEqual(id.Leaf().PublicKey, csrKey(t, reqs[0])) {
				t.Fatal("R4.9: the saved identity is not for the request's key")
			}
			if len(e.sleeps) != 1 || e.sleeps[0] != JoinMinBackoff {
				t.Errorf("waits %v, want [%s]", e.sleeps, JoinMinBackoff)
			}
			if !hasProgress(e, "sending the same request again in 2s (attempt 2 of 5)") {
				t.Errorf("progress %q", e.progress)
			}
			noPending(t, e)
		})
	}
}

// R4.9: a definite answer is not retried, and the request, which did not
// land, is not kept.
func TestJoinDefiniteAnswerNotRetriedR4_9(t *testing.T) {
	tests := []struct {
		name     string
		fail     error
		badToken bool
		code     errs.Code
	}{
		{name: "ACCESS_DENIED", badToken: true, code: errs.AccessDenied},
		{name: "CONFLICT", fail: errs.New(errs.Conflict, "This machine joined concurrently; retry"), code: errs.Conflict},
		{name: "INVALID_CONFIG", fail: errs.New(errs.InvalidConfig, "JoinService is not configured"), code: errs.InvalidConfig},
		{name: "INTERNAL", fail: errs.New(errs.Internal, "internal error"), code: errs.Internal},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t, envOption{})
			if tt.fail != nil {
				e.fake.Fail(tt.fail)
			}
			o := e.opts()
			if tt.badToken {
				o.Token = newToken(e.now)
			}
			_, err := e.joiner(e.cfg).Join(context.Background(), o)
			wantErr(t, "R4.9", err, tt.code)
			if e.fake.Calls() != 1 || len(e.sleeps) != 0 {
				t.Fatalf("R4.9: %d calls, waits %v; want one call, no wait", e.fake.Calls(), e.sleeps)
			}
			nothingSaved(t, "R4.9", e.store)
			noPending(t, e)
		})
	}
}

// R4.9: a join whose answers are all lost gives up after JoinAttempts, says
// where the request is kept, and the next bcd join with the same token sends
// that request again and gets the stored answer: nothing is spent twice.
func TestJoinPendingAcrossRunsR4_9(t *testing.T) {
	e := newEnv(t, envOption{})
	lost := make([]enrolltest.Loss, JoinAttempts)
	for i := range lost {
		lost[i] = enrolltest.Loss{Status: 503}
	}
	e.fake.LoseAnswers(lost...)
	_, err := e.joiner(e.cfg).Join(context.Background(), e.opts())
	wantErr(t, "R4.9", err, errs.Unavailable, "cannot join through", "the request is kept in "+e.pendingPath(), "bcd join again with the same token")
	if e.fake.Calls() != JoinAttempts || e.fake.Admissions() != 1 {
		t.Fatalf("R4.9: %d calls, %d admissions", e.fake.Calls(), e.fake.Admissions())
	}
	if want := []time.Duration{2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second}; len(e.sleeps) != len(want) ||
		e.sleeps[0] != want[0] || e.sleeps[3] != want[3] {
		t.Errorf("waits %v, want %v", e.sleeps, want)
	}
	nothingSaved(t, "R4.9", e.store)

	// The file: 0600, the token's hash, never the token.
	st, err := os.Stat(e.pendingPath())
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("R4.9: %s: %v %v", PendingFile, st, err)
	}
	data, _ := os.ReadFile(e.pendingPath())
	_, secret, _ := strings.Cut(e.token, ".")
	if strings.Contains(string(data), e.token) || strings.Contains(string(data), secret) {
		t.Fatal("R4.9: the token is in join.pending")
	}
	if !strings.Contains(string(data), TokenHash(e.token)) {
		t.Fatal("R4.9: join.pending lacks the token's hash")
	}

	first := e.fake.Requests()[0]
	e.progress = nil
	id, err := e.joiner(e.cfg).Join(context.Background(), e.opts())
	if err != nil {
		t.Fatalf("R4.9: the second run: %v", err)
	}
	reqs := e.fake.Requests()
	last := reqs[len(reqs)-1]
	if digestOf(last) != digestOf(first) || e.fake.Admissions() != 1 {
		t.Fatalf("R4.9: the second run sent another request (%d admissions)", e.fake.Admissions())
	}
	if !publicKeyEqual(id.Leaf().PublicKey, csrKey(t, first)) {
		t.Fatal("R4.9: the saved identity is not for the first request's key")
	}
	if hasProgress(e, "collecting hardware claims") || !hasProgress(e, "sending the request of an earlier join that got no answer") {
		t.Errorf("progress %q", e.progress)
	}
	noPending(t, e)
}

// R4.9: join.pending is sent again only for the same token, attestor, role,
// node id and site; any other join discards it and makes its own request.
func TestJoinPendingDiscardedR4_9(t *testing.T) {
	tests := []struct {
		name string
		// change makes the second join differ.
		change func(e *env, o *Options)
		// ok: the second join succeeds (another token is refused; another
		// site fails the answer's checks).
		ok bool
	}{
		{name: "another token", change: func(e *env, o *Options) { o.Token = newToken(e.now) }},
		{name: "another role", change: func(e *env, o *Options) { o.Role = pki.RoleSite }, ok: true},
		{name: "another node id", change: func(e *env, o *Options) { o.NodeID = ids.New(ids.Node, e.now) }, ok: true},
		{name: "another site", change: func(e *env, o *Options) { e.cfg.Site = ids.New(ids.Site, e.now.Add(time.Hour)) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t, envOption{})
			e.fake.LoseAnswers(enrolltest.Loss{Status: 503}, enrolltest.Loss{Status: 503}, enrolltest.Loss{Status: 503}, enrolltest.Loss{Status: 503}, enrolltest.Loss{Status: 503})
			if _, err := e.joiner(e.cfg).Join(context.Background(), e.opts()); errs.CodeOf(err) != errs.Unavailable {
				t.Fatalf("first run: %v", err)
			}
			first := e.fake.Requests()[0]
			o := e.opts()
			tt.change(e, &o)
			_, err := e.joiner(e.cfg).Join(context.Background(), o)
			if tt.ok != (err == nil) {
				t.Fatalf("second run: %v", err)
			}
			reqs := e.fake.Requests()
			last := reqs[len(reqs)-1]
			if digestOf(last) == digestOf(first) || publicKeyEqual(csrKey(t, last), csrKey(t, first)) {
				t.Fatal("R4.9: the pending request was sent for another join")
			}
			if data, err := os.ReadFile(e.pendingPath()); err == nil && strings.Contains(string(data), hex.EncodeToString(pki.JoinRequestDigest(first))) {
				t.Fatal("R4.9: the first request is still pending")
			}
		})
	}
}

// R4.9: a join.pending that cannot be trusted is never sent: a damaged file,
// one others can read, one whose answer was already saved.
func TestJoinPendingRefusedR4_9(t *testing.T) {
	// exhausted leaves join.pending behind and returns the first request.
	exhausted := func(t *testing.T, e *env) *agentv1.JoinRequest {
		t.Helper()
		e.fake.LoseAnswers(enrolltest.Loss{Status: 503}, enrolltest.Loss{Status: 503}, enrolltest.Loss{Status: 503}, enrolltest.Loss{Status: 503}, enrolltest.Loss{Status: 503})
		if _, err := e.joiner(e.cfg).Join(context.Background(), e.opts()); errs.CodeOf(err) != errs.Unavailable {
			t.Fatalf("first run: %v", err)
		}
		return e.fake.Requests()[0]
	}
	edit := func(t *testing.T, e *env, change func(p *pendingJSON)) {
		t.Helper()
		data, err := os.ReadFile(e.pendingPath())
		if err != nil {
			t.Fatal(err)
		}
		var p pendingJSON
		if err := json.Unmarshal(data, &p); err != nil {
			t.Fatal(err)
		}
		change(&p)
		out, _ := json.Marshal(p)
		if err := os.WriteFile(e.pendingPath(), out, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		name   string
		spoil  func(t *testing.T, e *env)
		reason string
	}{
		{name: "not JSON", reason: "not valid JSON", spoil: func(t *testing.T, e *env) {
			if err := os.WriteFile(e.pendingPath(), []byte("{"), 0o600); err != nil {
				t.Fatal(err)
			}
		}},
		{name: "readable by others", reason: "readable by group or others", spoil: func(t *testing.T, e *env) {
			if err := os.Chmod(e.pendingPath(), 0o644); err != nil {
				t.Fatal(err)
			}
		}},
		{name: "request changed", reason: "does not match its digest", spoil: func(t *testing.T, e *env) {
			edit(t, e, func(p *pendingJSON) {
				var r agentv1.JoinRequest
				if err := protojson.Unmarshal(p.Request, &r); err != nil {
					t.Fatal(err)
				}
				r.Claims.Hostname = "elsewhere"
				p.Request, _ = protojson.Marshal(&r)
			})
		}},
		{name: "another key", reason: "not the key of its certificate request", spoil: func(t *testing.T, e *env) {
			_, other, err := identity.SoftwareKeys{}.GenerateKey()
			if err != nil {
				t.Fatal(err)
			}
			edit(t, e, func(p *pendingJSON) { p.KeyRecord = string(other) })
		}},
		{name: "another version", reason: "version 2", spoil: func(t *testing.T, e *env) {
			edit(t, e, func(p *pendingJSON) { p.Version = 2 })
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t, envOption{})
			first := exhausted(t, e)
			tt.spoil(t, e)
			e.progress = nil
			if _, err := e.joiner(e.cfg).Join(context.Background(), e.opts()); err != nil {
				t.Fatal(err)
			}
			reqs := e.fake.Requests()
			if last := reqs[len(reqs)-1]; publicKeyEqual(csrKey(t, last), csrKey(t, first)) {
				t.Fatal("R4.9: a spoiled pending request was sent")
			}
			if !hasProgress(e, "discarding "+e.pendingPath()+": ") || !hasProgress(e, tt.reason) {
				t.Errorf("progress %q, want the reason %q", e.progress, tt.reason)
			}
			noPending(t, e)
		})
	}
	t.Run("its answer was saved", func(t *testing.T) {
		// A crash between saving the identity and removing join.pending:
		// the pending key is the identity's; a later join never sends it.
		e := newEnv(t, envOption{})
		first := exhausted(t, e)
		kept, err := os.ReadFile(e.pendingPath())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := e.joiner(e.cfg).Join(context.Background(), e.opts()); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(e.pendingPath(), kept, 0o600); err != nil {
			t.Fatal(err)
		}
		o := e.opts()
		o.Reset = true
		id, err := e.joiner(e.cfg).Join(context.Background(), o)
		if err != nil {
			t.Fatal(err)
		}
		if publicKeyEqual(id.Leaf().PublicKey, csrKey(t, first)) {
			t.Fatal("R4.9: the saved request was sent again")
		}
		noPending(t, e)
	})
	t.Run("stopped while waiting", func(t *testing.T) {
		// bcd is stopped between attempts: the request stays pending.
		e := newEnv(t, envOption{})
		e.fake.LoseAnswers(enrolltest.Loss{Status: 503})
		ctx, cancel := context.WithCancel(context.Background())
		c := e.config(e.cfg)
		c.Sleep = func(ctx context.Context, _ time.Duration) error { cancel(); return ctx.Err() }
		j, err := New(c)
		if err != nil {
			t.Fatal(err)
		}
		_, err = j.Join(ctx, e.opts())
		wantErr(t, "R4.9", err, errs.Unavailable, "stopped while waiting to retry", "the request is kept in")
		if e.fake.Calls() != 1 {
			t.Fatalf("calls %d", e.fake.Calls())
		}
		if _, err := os.Stat(e.pendingPath()); err != nil {
			t.Fatalf("R4.9: %v", err)
		}
	})
}

// R4.9, R10.5: an x509pop re-join whose answer is lost is sent again, the
// identical request (the same client time and proof), within the run and in
// the next one; an earlier request the control plane refuses (its proof
// outdated) is replaced by a fresh one, once.
func TestRejoinX509PopLostAnswerR4_9(t *testing.T) {
	x509popOpts := Options{Attestor: identity.AttestorX509Pop}
	t.Run("in the run", func(t *testing.T) {
		e := newEnv(t, envOption{})
		old := e.joinExpired(t)
		before := e.fake.Admissions()
		e.fake.LoseAnswers(enrolltest.Loss{Status: 502})
		id, err := e.joiner(e.cfg).Join(context.Background(), x509popOpts)
		if err != nil {
			t.Fatal(err)
		}
		reqs := e.fake.Requests()
		if !proto.Equal(reqs[len(reqs)-1], reqs[len(reqs)-2]) || e.fake.Admissions() != before+1 {
			t.Fatalf("R4.9: the retry is another request (%d admissions)", e.fake.Admissions()-before)
		}
		if id.NodeID != old.NodeID {
			t.Fatal(id.NodeID)
		}
		noPending(t, e)
	})
	t.Run("in the next run", func(t *testing.T) {
		e := newEnv(t, envOption{})
		old := e.joinExpired(t)
		before, calls := e.fake.Admissions(), e.fake.Calls()
		e.fake.LoseAnswers(enrolltest.Loss{Status: 503}, enrolltest.Loss{Status: 503}, enrolltest.Loss{Status: 503}, enrolltest.Loss{Status: 503}, enrolltest.Loss{Status: 503})
		_, err := e.joiner(e.cfg).Join(context.Background(), x509popOpts)
		wantErr(t, "R4.9", err, errs.Unavailable, "bcd join --attestor x509pop again")
		if cur, err := e.store.Load(); err != nil || cur.Serial != old.Serial {
			t.Fatalf("the expired identity: %v", err)
		}
		first := e.fake.Requests()[calls]
		id, err := e.joiner(e.cfg).Join(context.Background(), x509popOpts)
		if err != nil {
			t.Fatal(err)
		}
		reqs := e.fake.Requests()
		if !proto.Equal(reqs[len(reqs)-1], first) || e.fake.Admissions() != before+1 {
			t.Fatalf("R4.9: the next run sent another request (%d admissions)", e.fake.Admissions()-before)
		}
		if id.NodeID != old.NodeID || !publicKeyEqual(id.Leaf().PublicKey, csrKey(t, first)) {
			t.Fatal("R4.9: not the first request's identity")
		}
		noPending(t, e)
	})
	t.Run("refused earlier request", func(t *testing.T) {
		e := newEnv(t, envOption{})
		old := e.joinExpired(t)
		calls := e.fake.Calls()
		e.fake.LoseAnswers(enrolltest.Loss{Status: 503}, enrolltest.Loss{Status: 503}, enrolltest.Loss{Status: 503}, enrolltest.Loss{Status: 503}, enrolltest.Loss{Status: 503})
		if _, err := e.joiner(e.cfg).Join(context.Background(), x509popOpts); errs.CodeOf(err) != errs.Unavailable {
			t.Fatal(err)
		}
		first := e.fake.Requests()[calls]
		// The earlier proof no longer verifies (as an outdated one would
		// not): the fake refuses it.
		data, _ := os.ReadFile(e.pendingPath())
		var p pendingJSON
		if err := json.Unmarshal(data, &p); err != nil {
			t.Fatal(err)
		}
		var r agentv1.JoinRequest
		if err := protojson.Unmarshal(p.Request, &r); err != nil {
			t.Fatal(err)
		}
		r.X509Pop.Sig = []byte("outdated")
		p.Request, _ = protojson.Marshal(&r)
		out, _ := json.Marshal(p)
		if err := os.WriteFile(e.pendingPath(), out, 0o600); err != nil {
			t.Fatal(err)
		}
		e.progress = nil
		id, err := e.joiner(e.cfg).Join(context.Background(), x509popOpts)
		if err != nil {
			t.Fatal(err)
		}
		if id.NodeID != old.NodeID || publicKeyEqual(id.Leaf().PublicKey, csrKey(t, first)) {
			t.Fatal("R4.9: want a fresh request's identity")
		}
		if !hasProgress(e, "the control plane refused the earlier request; making a new one") {
			t.Errorf("progress %q", e.progress)
		}
		noPending(t, e)
	})
}
