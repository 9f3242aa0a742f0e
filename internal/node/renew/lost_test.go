package renew_test

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/node/renew"
)

// loseFirstRenewal is a transport whose first Renew reaches the control
// plane, which issues the certificate, and whose answer never comes back
// (a connection cut after the commit).
type loseFirstRenewal struct {
	next http.RoundTripper
	lost atomic.Bool
}

func (l *loseFirstRenewal) RoundTrip(r *http.Request) (*http.Response, error) {
	res, err := l.next.RoundTrip(r)
	if err != nil || !strings.HasSuffix(r.URL.Path, "/Renew") || !l.lost.CompareAndSwap(false, true) {
		return res, err
	}
	_, _ = io.Copy(io.Discard, res.Body)
	res.Body.Close()
	return nil, errors.New("connection reset by peer")
}

// R21.1: an answer the daemon never got does not strand it. The control
// plane issued the certificate and superseded the current one; the retry
// sends the same CSR from the same certificate and gets the same
// certificate back, where a new key would be refused (cert-superseded).
func TestLostRenewalAnswerDoesNotStrandR21_1(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		s := newStack(t, e)
		lossy := &loseFirstRenewal{}
		r := s.renewer(t, func(c *renew.Config) {
			c.HTTPClient = func(tc *tls.Config) *http.Client {
				if lossy.next == nil {
					lossy.next = &http.Transport{TLSClientConfig: tc, ForceAttemptHTTP2: true}
				}
				return &http.Client{Transport: lossy}
			}
		})
		if _, err := r.RenewOnce(context.Background()); err == nil {
			t.Fatal("the renewal whose answer was lost succeeded")
		}
		issued := s.certs(t, s.joined.NodeID)
		if len(issued) != 2 || issued[1].SupersededAt == nil {
			t.Fatalf("the control plane issued %d certificates; want the renewal's, superseding the first", len(issued))
		}
		got, err := r.RenewOnce(context.Background())
		if err != nil {
			t.Fatalf("the retry after the lost answer: %v", err)
		}
		if got.Serial != issued[0].Serial {
			t.Errorf("the retry saved serial %s, want the certificate already issued %s", got.Serial, issued[0].Serial)
		}
		if n := len(s.certs(t, s.joined.NodeID)); n != 2 {
			t.Errorf("%d certificates after the retry, want 2: nothing new is issued", n)
		}
		// From the new certificate the node renews as usual.
		if _, err := r.RenewOnce(context.Background()); err != nil {
			t.Fatalf("renewal from the re-answered certificate: %v", err)
		}
	})
}
