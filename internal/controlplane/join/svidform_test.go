package join_test

import (
	"context"
	"crypto/x509"
	"slices"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"

	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// formService is a JoinService on e's store and PKI that issues node
// certificates in form (pki.SVIDFormPage or pki.SVIDFormStrict).
func formService(t testing.TB, e *apitest.Env, c clock.Clock, form string) *join.Service {
	t.Helper()
	return ownServiceConfig(t, e, c, events.NewLimiter(c, 1000, time.Minute), 0, func(cfg *join.Config) {
		core, err := nodeident.New(nodeident.Config{DB: e.DB, Bundle: e.Bundle, Clock: c, CertTTL: 0, Hub: e.Server.Hub(), SVIDForm: form})
		if err != nil {
			t.Fatal(err)
		}
		cfg.Core = core
	})
}

// R20.1: the server's svid_form decides the form of every certificate it
// issues; a renewal reads the statements from the stored row (either form)
// and issues in the configured form, so switching the option moves a node
// over at its next renewal, and back. go-spiffe accepts the strict form.
func TestRenewSwitchesSVIDFormR20_1(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		r := newRenewEnv(t, f)
		n := r.join(t, f.acme, nil)
		// A certificate with a statement, as an attestor vouching for the
		// key would have issued it, in the default ("page") form.
		stmt := []string{"urn:bc:example:1"}
		stored := r.storeCert(t, n, pki.RoleNode, stmt, `[]`, 24*time.Hour)
		cur := &renewNode{id: n.id, key: n.key, chain: [][]byte{stored.DER, e.Bundle.NodeCA.Raw}, leaf: stored.DER}
		td := spiffeid.RequireTrustDomainFromString(e.Bundle.TrustDomain)
		bundle := x509bundle.FromX509Authorities(td, []*x509.Certificate{e.Bundle.NodeCA})
		svcs := map[string]*join.Service{
			pki.SVIDFormPage:   formService(t, e, r.clk, pki.SVIDFormPage),
			pki.SVIDFormStrict: formService(t, e, r.clk, pki.SVIDFormStrict),
		}
		for i, form := range []string{pki.SVIDFormStrict, pki.SVIDFormStrict, pki.SVIDFormPage, pki.SVIDFormStrict} {
			req, next := jointest.RenewRequest(t, cur.key, cur.chain, cur.id, r.clk.Now())
			res, err := svcs[form].Renew(context.Background(), req, join.Peer{Addr: "192.0.2.7:40001", Cert: cur.leaf})
			if err != nil {
				t.Fatalf("renewal %d (%s): %v", i, form, err)
			}
			got := next.VerifyRenewal(t, e.Bundle, res, pki.RoleNode)
			if !slices.Equal(got.Identity.Statements, stmt) {
				t.Errorf("renewal %d (%s): statements %v, want %v", i, form, got.Identity.Statements, stmt)
			}
			_, _, spiffeErr := x509svid.Verify([]*x509.Certificate{got.Leaf}, bundle)
			switch form {
			case pki.SVIDFormStrict:
				if len(got.Leaf.URIs) != 1 || spiffeErr != nil {
					t.Errorf("renewal %d (strict): %d URI SANs, go-spiffe: %v", i, len(got.Leaf.URIs), spiffeErr)
				}
			case pki.SVIDFormPage:
				if len(got.Leaf.URIs) != 2 || got.Leaf.URIs[1].String() != stmt[0] || spiffeErr == nil {
					t.Errorf("renewal %d (page): URIs %v, go-spiffe: %v", i, got.Leaf.URIs, spiffeErr)
				}
			}
			cur = &renewNode{id: n.id, key: next.Key, chain: got.Body.CertChain, leaf: got.Leaf.Raw}
			r.clk.Advance(time.Second)
		}
	})
}

// R20.1: an unknown svid_form is a configuration error.
func TestSVIDFormConfigR20_1(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		for _, tt := range []struct {
			form string
			ok   bool
		}{{"", true}, {pki.SVIDFormPage, true}, {pki.SVIDFormStrict, true}, {"strict", false}} {
			_, err := nodeident.New(nodeident.Config{DB: e.DB, Bundle: e.Bundle, SVIDForm: tt.form})
			if (err == nil) != tt.ok {
				t.Errorf("SVIDForm %q: err %v, want ok %v", tt.form, err, tt.ok)
			}
		}
	})
}
