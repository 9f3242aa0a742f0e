package identity

import (
	"path/filepath"
	"testing"
	"time"
)

// Two identities of the same CA, loaded in one process, share the parsed
// CA and command-signing certificates and keep their own node
// certificates; the shared ones are the parse of exactly their bytes.
func TestLoadSharesCACertificates(t *testing.T) {
	f := newPKI(t)
	var ids []*Identity
	for i, node := range []string{"node_01k5x", "node_01k5y"} {
		s := &Store{Dir: filepath.Join(t.TempDir(), "bcd")}
		is := f.issue(t, SoftwareKeys{}, node, t0.Add(time.Duration(i)*time.Minute), 24*time.Hour)
		is.save(t, s)
		id, err := s.Load()
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	a, b := ids[0], ids[1]
	if len(a.Chain) != 2 || len(a.Bundle) != 1 {
		t.Fatalf("chain %d, bundle %d certificates", len(a.Chain), len(a.Bundle))
	}
	if a.Chain[0] == b.Chain[0] || a.Chain[0].Equal(b.Chain[0]) {
		t.Error("two nodes share a node certificate")
	}
	if a.Chain[1] != b.Chain[1] || a.Bundle[0] != b.Bundle[0] {
		t.Error("the node CA or the command-signing certificate was parsed once per identity")
	}
	if !a.Chain[1].Equal(f.b.NodeCA) || !a.Bundle[0].Equal(f.b.CommandSigningCert) {
		t.Error("a shared certificate is not the one saved")
	}
}
