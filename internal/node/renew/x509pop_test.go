package renew_test

// `bcd join --attestor x509pop` (R10.5) through the same in-process stack as
// the renewal tests: the real API (here running the x509pop attestor), its
// agent listener and a real gateway.

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/pem"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	bcdcli "github.com/better-compute/better-compute/internal/node/bcdcmd"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// withX509Pop runs the x509pop attestor, with CAs valid for the last 30
// days so that they certify certificates that expired days ago.
var withX509Pop = apitest.Options{Attestors: []string{"join-token", "x509pop"}, PKIFrom: time.Now().Add(-30 * 24 * time.Hour)}

// expire replaces the stack's identity with a certificate for the same key
// and node that expired ago: a node_certs row of the node's current
// generation, as if the machine had been offline since.
func (s *stack) expire(t *testing.T, ago time.Duration) *identity.Identity {
	t.Helper()
	ctx := context.Background()
	b := s.e.Bundle
	id := s.joined
	na := time.Now().Add(-ago)
	nc, err := ca.SignNodeCertKey(b.NodeCA, b.NodeCAKey, keyOf(t, id), ca.NodeCertParams{
		TrustDomain: b.TrustDomain, SiteID: id.SiteID, NodeID: id.NodeID, Role: id.Role, NotBefore: na.Add(-24 * time.Hour), NotAfter: na,
	})
	if err != nil {
		t.Fatal(err)
	}
	err = s.e.DB.WithTx(ctx, func(tx *store.Tx) error {
		n, err := tx.GetNode(ctx, id.NodeID)
		if err != nil {
			return err
		}
		return tx.InsertNodeCert(ctx, store.NodeCert{Serial: nc.Serial, NodeID: n.ID, IdentityGeneration: n.IdentityGeneration, Role: id.Role,
			SPKISHA256: nc.SPKISHA256, DER: nc.DER, NotBefore: nc.Cert.NotBefore, NotAfter: nc.Cert.NotAfter})
	})
	if err != nil {
		t.Fatal(err)
	}
	chainPEM := append(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: nc.DER}), pki.CertPEM(b.NodeCA)...)
	keyRecord, err := os.ReadFile(filepath.Join(s.store.Dir, identity.KeyFile))
	if err != nil {
		t.Fatal(err)
	}
	bundlePEM, err := os.ReadFile(filepath.Join(s.store.Dir, identity.BundleFile))
	if err != nil {
		t.Fatal(err)
	}
	expired, err := identity.NewIdentity(chainPEM, id.Attestor, id.JoinedAt)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.store.Save(expired, keyRecord, chainPEM, bundlePEM); err != nil {
		t.Fatal(err)
	}
	loaded, err := s.store.Load()
	if err != nil {
		t.Fatalf("the expired identity does not load: %v", err)
	}
	return loaded
}

// bcdJoinX509Pop runs `bcd join --config … --attestor x509pop --json`.
func (s *stack) bcdJoinX509Pop(t *testing.T) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = bcdcli.Main(context.Background(), []string{"join", "--config", s.configPath, "--attestor", "x509pop", "--json"},
		bcdcli.Env{Stdin: strings.NewReader(""), Stdout: &out, Stderr: &errb, HTTPClient: noProxy,
			LookupEnv: func(string) (string, bool) { return "", false }, Unsetenv: func(string) error { return nil },
			StdinIsTerminal: func() bool { return true }})
	return code, out.String(), errb.String()
}

// R10.5: a machine whose certificate expired an hour ago while it was
// offline comes back with `bcd join --attestor x509pop`: no token, the same
// node id, the next identity generation, a new key and a valid certificate;
// the expired certificate is revoked and the expired identity is kept aside.
func TestJoinX509PopThroughGatewayR10_5(t *testing.T) {
	apitest.Each(t, withX509Pop, func(t *testing.T, e *apitest.Env) {
		s := newStack(t, e)
		old := s.expire(t, time.Hour)

		code, stdout, stderr := s.bcdJoinX509Pop(t)
		if code != 0 {
			t.Fatalf("bcd join --attestor x509pop: exit %d: %s", code, stderr)
		}
		var st bcdcli.Status
		if err := json.Unmarshal([]byte(stdout), &st); err != nil {
			t.Fatalf("--json: %v: %s", err, stdout)
		}
		cur, err := s.store.Load()
		if err != nil {
			t.Fatalf("the new identity does not load: %v", err)
		}
		switch {
		case cur.NodeID != old.NodeID || st.NodeID != old.NodeID:
			t.Errorf("re-joined as %s (printed %s), want %s", cur.NodeID, st.NodeID, old.NodeID)
		case cur.Serial == old.Serial || cur.Expired(time.Now()) || cur.Attestor != identity.AttestorX509Pop:
			t.Errorf("identity %+v: want a new, valid certificate from x509pop", cur)
		case keyOf(t, cur).Equal(keyOf(t, old)):
			t.Error("the new certificate is for the expired certificate's key")
		case cur.Role != old.Role || cur.SiteID != old.SiteID || cur.SPIFFEID != old.SPIFFEID:
			t.Errorf("identity %+v, want the node of %+v", cur, old)
		}
		var node store.Node
		err = e.DB.ReadTx(context.Background(), func(tx *store.Tx) (err error) {
			node, err = tx.GetNode(context.Background(), old.NodeID)
			return
		})
		if err != nil {
			t.Fatal(err)
		}
		if node.IdentityGeneration != 2 || node.Attestor != "x509pop" {
			t.Errorf("node generation %d attestor %s, want 2, x509pop", node.IdentityGeneration, node.Attestor)
		}
		for _, c := range s.certs(t, old.NodeID) {
			if c.Serial == cur.Serial {
				if c.RevokedAt != nil || c.IdentityGeneration != 2 {
					t.Errorf("new certificate revoked %v generation %d", c.RevokedAt, c.IdentityGeneration)
				}
			} else if c.RevokedAt == nil || c.RevokeReason != "rejoined" {
				t.Errorf("older certificate %s: revoked %v (%q), want rejoined", c.Serial, c.RevokedAt, c.RevokeReason)
			}
		}
		// The expired identity was moved aside, as --reset does.
		aside, _ := filepath.Glob(filepath.Join(s.store.Dir, "reset-*", identity.IdentityFile))
		if len(aside) != 1 {
			t.Fatalf("expired identities kept aside: %v, want one", aside)
		}
		kept, err := (&identity.Store{Dir: filepath.Dir(aside[0])}).Load()
		if err != nil || kept.Serial != old.Serial {
			t.Errorf("the identity kept aside: %v, %v; want the expired one", kept, err)
		}
	})
}

// R10.5: a certificate expired for longer than 7 days does not come back:
// bcd reports the refusal with what to do, keeps the expired identity, and
// the reason is in the owner's events.
func TestJoinX509PopExpiredTooLongR10_5(t *testing.T) {
	apitest.Each(t, withX509Pop, func(t *testing.T, e *apitest.Env) {
		s := newStack(t, e)
		old := s.expire(t, 8*24*time.Hour)

		code, _, stderr := s.bcdJoinX509Pop(t)
		if code == 0 || !strings.Contains(stderr, "Join refused") || !strings.Contains(stderr, "within 168h0m0s") {
			t.Fatalf("bcd join --attestor x509pop: exit %d: %s; want Join refused", code, stderr)
		}
		cur, err := s.store.Load()
		if err != nil || cur.Serial != old.Serial {
			t.Fatalf("identity after the refusal: %v (%v); want the expired one kept", cur, err)
		}
		if got := jointest.Reasons(t, e.DB, e.RootTenant); len(got) != 1 || got[0] != "x509pop:cert-expired-too-long" {
			t.Errorf("refusals %v, want x509pop:cert-expired-too-long", got)
		}
	})
}

// R10.5: bcd refuses before sending anything when there is nothing to
// re-join with: a certificate that is still valid renews instead, and a
// machine without an identity joins with a token.
func TestJoinX509PopLocalRefusalsR10_5(t *testing.T) {
	apitest.Each(t, withX509Pop, func(t *testing.T, e *apitest.Env) {
		s := newStack(t, e)
		before := s.calls.Load()
		code, _, stderr := s.bcdJoinX509Pop(t)
		if code == 0 || !strings.Contains(stderr, "the certificate is still valid: bcd renews it; run bcd renew") {
			t.Fatalf("valid certificate: exit %d: %s", code, stderr)
		}
		if _, err := s.store.MoveAside(time.Now()); err != nil {
			t.Fatal(err)
		}
		code, _, stderr = s.bcdJoinX509Pop(t)
		if code == 0 || !strings.Contains(stderr, "no identity in") {
			t.Fatalf("no identity: exit %d: %s", code, stderr)
		}
		if n := s.calls.Load() - before; n != 0 {
			t.Errorf("%d calls reached the API, want none", n)
		}
	})
}
