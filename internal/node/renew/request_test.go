package renew_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/renew"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// R13.1: the due time is 45% to 75% of the lifetime, 60% at the mean.
func TestDueAt(t *testing.T) {
	nb := time.Unix(1_800_000_000, 0)
	na := nb.Add(100 * time.Second)
	for _, c := range []struct {
		r    float64
		want time.Duration
	}{{0, 45 * time.Second}, {0.5, 60 * time.Second}, {1, 75 * time.Second}} {
		if got := renew.DueAt(nb, na, c.r).Sub(nb); got != c.want {
			t.Errorf("r %v: due after %s, want %s", c.r, got, c.want)
		}
	}
}

// R13.1, R21.2: the request carries the proof of possession by the
// current key over the CSR, the node and the time, and the pins it holds
// acknowledged over the CSR's hash; both verify as the control plane
// checks them.
func TestNewRequest(t *testing.T) {
	cur, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	next, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	csr, err := identity.NewCSR(next, "node_1")
	if err != nil {
		t.Fatal(err)
	}
	pin, err := pki.Pin(cur.Public())
	if err != nil {
		t.Fatal(err)
	}
	now := time.UnixMilli(1_800_000_000_123)
	req, err := renew.NewRequest(cur, "node_1", [][]byte{[]byte("leaf")}, csr, now, []string{pin})
	if err != nil {
		t.Fatal(err)
	}
	if req.GetNodeId() != "node_1" || req.GetClientTimeUnixMs() != now.UnixMilli() || len(req.GetChain()) != 1 {
		t.Fatalf("%+v", req)
	}
	if err := pki.VerifyRenewPoP(cur.Public(), csr, "node_1", now.UnixMilli(), req.GetPopSig()); err != nil {
		t.Fatalf("proof of possession: %v", err)
	}
	if err := pki.VerifyPinsAck(cur.Public(), pki.CSRHash(csr), req.GetPins(), req.GetPinsSig()); err != nil {
		t.Fatalf("pins: %v", err)
	}
}

// R13.1: a retry waits the backoff's wait, never more than 40% to 60% of
// the validity left, never less than MinBackoff.
func TestRetryIn(t *testing.T) {
	for _, c := range []struct {
		wait, left time.Duration
		r          float64
		want       time.Duration
	}{
		{10 * time.Second, time.Hour, 0.5, 10 * time.Second},
		{time.Hour, 100 * time.Second, 0, 40 * time.Second},
		{time.Hour, 100 * time.Second, 1, 60 * time.Second},
		{time.Hour, time.Second, 0.5, renew.MinBackoff},
	} {
		if got := renew.RetryIn(c.wait, c.left, c.r); got != c.want {
			t.Errorf("RetryIn(%s, %s, %v) = %s, want %s", c.wait, c.left, c.r, got, c.want)
		}
	}
}
