package loadgen

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"slices"
	"sync"
	"testing"

	"github.com/better-compute/better-compute/internal/node/config"
	"github.com/better-compute/better-compute/internal/node/nodesession"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// R21.2: the lean daemons hold the pins of their bcd configuration, read
// once: Hello acknowledges the same pins bcd's config.Pins would, and a
// renewal checks its answer under the same join-signing set and retired
// keys. The slices are shared by every daemon, so they are clipped: an
// append by any reader copies instead of writing into another's.
func TestLeanPinsReadOnce(t *testing.T) {
	pin := func() string {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		p, err := pki.Pin(&key.PublicKey)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	c := &bcdconfig.Config{RetiredPins: []string{pin()}}
	c.SetPinSet(pki.KindServingCA, []string{pin()})
	c.SetPinSet(pki.KindJoinSigning, []string{pin(), pin()})
	c.SetPinSet(pki.KindJoinEncryption, []string{pin()})
	p := config.NewPins("", c, nil)
	lp := newLeanPins(p)
	for _, tc := range []struct {
		name      string
		got, want []string
	}{
		{"held", lp.held, p.Held()},
		{"join signing", lp.signing, p.Set(pki.KindJoinSigning)},
		{"retired", lp.retired, p.Retired()},
	} {
		if !slices.Equal(tc.got, tc.want) || len(tc.got) == 0 {
			t.Errorf("%s: %v, want %v", tc.name, tc.got, tc.want)
		}
		if cap(tc.got) != len(tc.got) {
			t.Errorf("%s: capacity %d past its length %d", tc.name, cap(tc.got), len(tc.got))
		}
	}

	// Many daemons answer their Challenges at once over the shared pins
	// (the race detector checks that none writes into them).
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	nonce := make([]byte, pki.SessionNonceSize)
	var wg sync.WaitGroup
	for range 32 {
		wg.Go(func() {
			_, hello, err := nodesession.Answer(key, "node-1", []byte("leaf"), nonce, lp.held)
			if err != nil {
				t.Error(err)
				return
			}
			if !slices.Equal(hello.GetPins(), p.Held()) {
				t.Errorf("Hello acknowledges %v, want %v", hello.GetPins(), p.Held())
			}
			_ = append(lp.held, "extra")
		})
	}
	wg.Wait()
}
