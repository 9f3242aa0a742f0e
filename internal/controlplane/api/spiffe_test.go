package api_test

import (
	"context"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/federation"
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/better-compute/better-compute/internal/controlplane/api"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// R20.2: go-spiffe's federation client fetches the trust domain's bundle
// (https_web) from the API: the node CAs as x509-svid authorities, a
// refresh hint and a sequence number. The bundle follows the node CA's
// rotation (prepare, activate, retire) with a sequence that goes up when
// the set of CAs changes, and the well-known document carries the same.
func TestSPIFFEBundleEndpointR20_2(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		ts := httptest.NewTLSServer(e.Server)
		t.Cleanup(ts.Close)
		roots := x509.NewCertPool()
		roots.AddCert(ts.Certificate())
		td := spiffeid.RequireTrustDomainFromString(e.Bundle.TrustDomain)
		url := ts.URL + api.DefaultBasePath + api.SPIFFEBundlePath

		// A rotation of the node CA, as the rotation package swaps the
		// live bundle.
		live := ca.NewLive(e.Bundle)
		first := e.Bundle
		der, key, err := ca.NewKeyOf(ca.KindNodeCA, first.TrustDomain, 2, time.Now().Add(-time.Minute))
		if err != nil {
			t.Fatal(err)
		}
		next, err := x509.ParseCertificate(der)
		if err != nil {
			t.Fatal(err)
		}
		prepared, activated, retired := *first, *first, *first
		prepared.NodeCAs = []*x509.Certificate{first.NodeCA, next}
		activated.NodeCA, activated.NodeCAKey, activated.NodeCAs = next, key, []*x509.Certificate{next, first.NodeCA}
		retired.NodeCA, retired.NodeCAKey, retired.NodeCAs = next, key, []*x509.Certificate{next}

		steps := []struct {
			name string
			b    *ca.Bundle
			want []*x509.Certificate
			seq  uint64
		}{
			{"initial", first, []*x509.Certificate{first.NodeCA}, 2},
			{"prepared", &prepared, []*x509.Certificate{first.NodeCA, next}, 3},
			{"activated", &activated, []*x509.Certificate{next, first.NodeCA}, 3},
			{"retired", &retired, []*x509.Certificate{next}, 4},
		}
		for _, st := range steps {
			live.Set(st.b)
			got, err := federation.FetchBundle(context.Background(), td, url, federation.WithWebPKIRoots(roots))
			if err != nil {
				t.Fatalf("%s: federation.FetchBundle: %v", st.name, err)
			}
			auth := got.X509Authorities()
			if len(auth) != len(st.want) {
				t.Fatalf("%s: %d authorities, want %d", st.name, len(auth), len(st.want))
			}
			for i := range auth {
				if !auth[i].Equal(st.want[i]) {
					t.Errorf("%s: authority %d is %s, want %s", st.name, i, auth[i].Subject, st.want[i].Subject)
				}
			}
			if hint, ok := got.RefreshHint(); !ok || hint != api.SPIFFERefreshHint {
				t.Errorf("%s: refresh hint %v (%v)", st.name, hint, ok)
			}
			if seq, ok := got.SequenceNumber(); !ok || seq != st.seq {
				t.Errorf("%s: sequence %d (%v), want %d", st.name, seq, ok, st.seq)
			}
			if len(got.JWTAuthorities()) != 0 {
				t.Errorf("%s: JWT authorities %v", st.name, got.JWTAuthorities())
			}

			doc := wellKnown(t, ts.Client(), ts.URL)
			if doc.SPIFFE == nil || doc.SPIFFE.TrustDomain != first.TrustDomain || doc.SPIFFE.Sequence != st.seq ||
				doc.SPIFFE.BundleEndpoint != api.DefaultBasePath+api.SPIFFEBundlePath || len(doc.SPIFFE.NodeCAs) != len(st.want) {
				t.Fatalf("%s: well-known spiffe %+v", st.name, doc.SPIFFE)
			}
			for i, b64 := range doc.SPIFFE.NodeCAs {
				if raw, err := base64.StdEncoding.DecodeString(b64); err != nil || string(raw) != string(st.want[i].Raw) {
					t.Errorf("%s: well-known node CA %d is not %s", st.name, i, st.want[i].Subject)
				}
			}
		}
	})
}

// R20.2: without a machine PKI there is no bundle to publish.
func TestSPIFFEBundleWithoutPKIR20_2(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		res, err := http.Get(e.URL + api.DefaultBasePath + api.SPIFFEBundlePath)
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		if res.StatusCode != http.StatusNotFound {
			t.Errorf("status %d, want 404", res.StatusCode)
		}
		if doc := wellKnown(t, http.DefaultClient, e.URL); doc.SPIFFE != nil {
			t.Errorf("well-known spiffe %+v without a PKI", doc.SPIFFE)
		}
	})
}

// wellKnown fetches and decodes the well-known document from the server
// at base.
func wellKnown(t *testing.T, hc *http.Client, base string) wire.WellKnown {
	t.Helper()
	res, err := hc.Get(base + api.DefaultBasePath + "/.well-known/better-compute")
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	var doc wire.WellKnown
	if err := json.NewDecoder(res.Body).Decode(&doc); err != nil {
		t.Fatal(err)
	}
	return doc
}
