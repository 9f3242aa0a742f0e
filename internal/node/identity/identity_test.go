package identity

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

const testTD = "compute.example.com"

// issued is one node identity as a join would return it.
type issued struct {
	id        *Identity
	record    []byte
	chainPEM  []byte
	bundlePEM []byte
}

type pkiFixture struct {
	b *ca.Bundle
}

func newPKI(t *testing.T) pkiFixture {
	t.Helper()
	b, err := ca.Generate(testTD, t0.Add(-72*time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	return pkiFixture{b: b}
}

// issue makes a key in ks, a CSR, and a certificate for node valid from
// notBefore for lifetime.
func (f pkiFixture) issue(t *testing.T, ks KeyStore, node string, notBefore time.Time, lifetime time.Duration) issued {
	t.Helper()
	signer, record, err := ks.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	csr, err := NewCSR(signer, "rack-b7-u12")
	if err != nil {
		t.Fatal(err)
	}
	nc, err := ca.SignNodeCert(f.b.NodeCA, f.b.NodeCAKey, csr, ca.NodeCertParams{
		TrustDomain: testTD, SiteID: "site_01k5w", NodeID: node, Role: pki.RoleNode,
		NotBefore: notBefore, NotAfter: notBefore.Add(lifetime),
	})
	if err != nil {
		t.Fatal(err)
	}
	chainPEM := append(pki.CertPEM(nc.Cert), pki.CertPEM(f.b.NodeCA)...)
	id, err := NewIdentity(chainPEM, "", t0)
	if err != nil {
		t.Fatal(err)
	}
	return issued{id: id, record: record, chainPEM: chainPEM, bundlePEM: pki.CertPEM(f.b.CommandSigningCert)}
}

func (is issued) save(t *testing.T, s *Store) {
	t.Helper()
	if err := s.Save(is.id, is.record, is.chainPEM, is.bundlePEM); err != nil {
		t.Fatalf("Save: %v", err)
	}
}

func mode(t *testing.T, path string) os.FileMode {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Mode().Perm()
}

// leftovers lists what Save must not leave in the data directory.
func leftovers(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), stagingPrefix) || strings.HasPrefix(e.Name(), previousPrefix) {
			out = append(out, e.Name())
		}
	}
	return out
}

// R4.1, R4.6: a saved identity loads back, with the modes R4.1 names.
func TestSaveLoad(t *testing.T) {
	f := newPKI(t)
	dir := filepath.Join(t.TempDir(), "var", "lib", "bcd")
	s := &Store{Dir: dir}
	is := f.issue(t, SoftwareKeys{}, "node_01k5x", t0, 24*time.Hour)
	is.save(t, s)

	for _, c := range []struct {
		path string
		want os.FileMode
	}{
		{dir, 0o700}, {filepath.Join(dir, KeyFile), 0o600},
		{filepath.Join(dir, CertFile), 0o644}, {filepath.Join(dir, BundleFile), 0o644},
		{filepath.Join(dir, IdentityFile), 0o644},
	} {
		if got := mode(t, c.path); got != c.want {
			t.Errorf("R4.1: %s mode %04o, want %04o", c.path, got, c.want)
		}
	}
	if l := leftovers(t, dir); len(l) != 0 {
		t.Errorf("Save left %v", l)
	}

	got, err := s.Load()
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	want := is.id
	if got.NodeID != "node_01k5x" || got.SiteID != "site_01k5w" || got.TrustDomain != testTD ||
		got.Role != pki.RoleNode || got.SPIFFEID != "spiffe://"+testTD+"/site/site_01k5w/node/node_01k5x" ||
		got.Serial != want.Serial || !got.NotAfter.Equal(t0.Add(24*time.Hour)) || !got.JoinedAt.Equal(t0) ||
		got.Attestor != AttestorJoinToken || got.KeyKind != KindSoftware {
		t.Errorf("R4.6: loaded %+v", got)
	}
	if len(got.Chain) != 2 || len(got.Bundle) != 1 || !got.Bundle[0].Equal(f.b.CommandSigningCert) {
		t.Errorf("chain %d bundle %d", len(got.Chain), len(got.Bundle))
	}
	if !publicKeyEqual(got.Signer.Public(), got.Leaf().PublicKey) {
		t.Error("the signer is not the leaf's key")
	}
	if got.Expired(t0.Add(time.Hour)) || !got.Expired(t0.Add(24*time.Hour)) {
		t.Error("Expired")
	}

	if got.IdentityGeneration != 0 {
		t.Errorf("an identity saved without a generation loads generation %d, want 0 (unknown)", got.IdentityGeneration)
	}
	if raw, _ := os.ReadFile(filepath.Join(dir, IdentityFile)); strings.Contains(string(raw), "identity_generation") {
		t.Errorf("identity.json names a generation it does not know: %s", raw)
	}

	// A renewal replaces the identity in place; R12.3: the generation is
	// kept with it.
	next := f.issue(t, SoftwareKeys{}, "node_01k5x", t0.Add(14*time.Hour), 24*time.Hour)
	next.id.IdentityGeneration = 3
	next.save(t, s)
	got, err = s.Load()
	if err != nil {
		t.Fatalf("after replace: %v", err)
	}
	if got.Serial != next.id.Serial || got.IdentityGeneration != 3 {
		t.Errorf("after replace: serial %s generation %d", got.Serial, got.IdentityGeneration)
	}
}

// R11.4: an expired certificate still loads ("bcd keeps such an identity").
func TestLoadExpired(t *testing.T) {
	f := newPKI(t)
	s := &Store{Dir: t.TempDir()}
	f.issue(t, SoftwareKeys{}, "node_01k5x", t0.Add(-48*time.Hour), 24*time.Hour).save(t, s)
	id, err := s.Load()
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	if !id.Expired(t0) {
		t.Fatal("not expired")
	}
}

func TestLoadNotJoined(t *testing.T) {
	for _, dir := range []string{"", "missing"} {
		s := &Store{Dir: filepath.Join(t.TempDir(), dir)}
		if _, err := s.Load(); !errors.Is(err, ErrNotJoined) {
			t.Fatalf("R11.4: Load of an empty directory: %v, want ErrNotJoined", err)
		}
	}
}

// R4.1: Load refuses an identity it cannot trust, and says how to fix it.
func TestLoadRefuses(t *testing.T) {
	f := newPKI(t)
	tests := []struct {
		name   string
		req    string
		damage func(t *testing.T, dir string, is issued)
		code   errs.Code
		want   []string
	}{
		{
			name: "key readable by others", req: "R4.1",
			damage: func(t *testing.T, dir string, _ issued) { chmod(t, filepath.Join(dir, KeyFile), 0o644) },
			code:   errs.InvalidState, want: []string{"readable by group or others (mode 0644, want 0600)", "chmod 600"},
		},
		{
			name: "key readable by group", req: "R4.1",
			damage: func(t *testing.T, dir string, _ issued) { chmod(t, filepath.Join(dir, KeyFile), 0o640) },
			code:   errs.InvalidState, want: []string{"mode 0640"},
		},
		{
			name: "key is a symlink", req: "R4.1",
			damage: func(t *testing.T, dir string, _ issued) {
				p := filepath.Join(dir, KeyFile)
				other := filepath.Join(t.TempDir(), "key")
				if err := os.Rename(p, other); err != nil {
					t.Fatal(err)
				}
				if err := os.Symlink(other, p); err != nil {
					t.Fatal(err)
				}
			},
			code: errs.InvalidState, want: []string{"not a regular file"},
		},
		{
			name: "incomplete", req: "R11.4",
			damage: func(t *testing.T, dir string, _ issued) { remove(t, filepath.Join(dir, BundleFile)) },
			code:   errs.InvalidState, want: []string{"incomplete (no bundle.pem)", "bcd join --reset --yes"},
		},
		{
			name: "identity.json about another node", req: "R4.6",
			damage: func(t *testing.T, dir string, _ issued) {
				p := filepath.Join(dir, IdentityFile)
				data, _ := os.ReadFile(p)
				write(t, p, []byte(strings.ReplaceAll(string(data), "node_01k5x", "node_01k5y")), 0o644)
			},
			code: errs.InvalidState, want: []string{"does not describe the certificate", "bcd join --reset --yes"},
		},
		{
			name: "key of another certificate", req: "R4.6",
			damage: func(t *testing.T, dir string, _ issued) {
				_, rec, _ := SoftwareKeys{}.GenerateKey()
				write(t, filepath.Join(dir, KeyFile), rec, 0o600)
			},
			code: errs.InvalidState, want: []string{"node.key is not the key of the certificate"},
		},
		{
			name: "TPM record without a TPM", req: "R9.1",
			damage: func(t *testing.T, dir string, _ issued) {
				write(t, filepath.Join(dir, KeyFile), pem.EncodeToMemory(&pem.Block{Type: PEMTypeTPM, Bytes: []byte{0x30, 0}}), 0o600)
			},
			code: errs.InvalidConfig, want: []string{"TPM key record"},
		},
		{
			name: "bundle not certificates", req: "R4.6",
			damage: func(t *testing.T, dir string, _ issued) {
				write(t, filepath.Join(dir, BundleFile), []byte("hello"), 0o644)
			},
			code: errs.InvalidState, want: []string{"bundle.pem"},
		},
		{
			name: "negative generation", req: "R12.3",
			damage: func(t *testing.T, dir string, _ issued) {
				p := filepath.Join(dir, IdentityFile)
				data, _ := os.ReadFile(p)
				write(t, p, []byte(strings.Replace(string(data), "{", `{"identity_generation": -1,`, 1)), 0o644)
			},
			code: errs.InvalidState, want: []string{"negative identity_generation"},
		},
		{
			name: "broken json", req: "R4.6",
			damage: func(t *testing.T, dir string, _ issued) {
				write(t, filepath.Join(dir, IdentityFile), []byte("{"), 0o644)
			},
			code: errs.InvalidState, want: []string{"identity.json is not valid JSON"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := &Store{Dir: t.TempDir()}
			is := f.issue(t, SoftwareKeys{}, "node_01k5x", t0, time.Hour)
			is.save(t, s)
			tt.damage(t, s.Dir, is)
			_, err := s.Load()
			if errs.CodeOf(err) != tt.code {
				t.Fatalf("%s: got %v, want %s", tt.req, err, tt.code)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("%s: %q lacks %q", tt.req, err, w)
				}
			}
		})
	}
}

// R4.1: nothing of a failed Save remains and an old identity is untouched,
// whichever step fails.
func TestSaveFailureIsAtomic(t *testing.T) {
	f := newPKI(t)
	for step := range len(fileNames()) {
		for _, withOld := range []bool{false, true} {
			t.Run(fmt.Sprintf("rename %d old %v", step, withOld), func(t *testing.T) {
				s := &Store{Dir: t.TempDir()}
				var old issued
				if withOld {
					old = f.issue(t, SoftwareKeys{}, "node_01k5x", t0, time.Hour)
					old.save(t, s)
				}
				n := 0
				s.rename = func(a, b string) error {
					if n == step {
						return errors.New("injected")
					}
					n++
					return os.Rename(a, b)
				}
				next := f.issue(t, SoftwareKeys{}, "node_01k5x", t0.Add(time.Minute), time.Hour)
				if err := s.Save(next.id, next.record, next.chainPEM, next.bundlePEM); err == nil || !strings.Contains(err.Error(), "injected") {
					t.Fatalf("Save: %v", err)
				}
				if l := leftovers(t, s.Dir); len(l) != 0 {
					t.Errorf("left %v", l)
				}
				s.rename = nil
				got, err := s.Load()
				if !withOld {
					if present, _ := s.Present(); len(present) != 0 || !errors.Is(err, ErrNotJoined) {
						t.Fatalf("R4.1: after a failed first Save: %v present, %v", present, err)
					}
					return
				}
				if err != nil || got.Serial != old.id.Serial {
					t.Fatalf("R4.1: the old identity changed: %v", err)
				}
				key, _ := os.ReadFile(filepath.Join(s.Dir, KeyFile))
				if string(key) != string(old.record) {
					t.Fatal("R4.1: the old key changed")
				}
			})
		}
	}
}

// Save never writes a key that is not the certificate's.
func TestSaveRefusesMismatch(t *testing.T) {
	f := newPKI(t)
	s := &Store{Dir: t.TempDir()}
	a := f.issue(t, SoftwareKeys{}, "node_01k5x", t0, time.Hour)
	b := f.issue(t, SoftwareKeys{}, "node_01k5x", t0, time.Hour)
	tests := []struct {
		name string
		fn   func() error
	}{
		{"other key", func() error { return s.Save(a.id, b.record, a.chainPEM, a.bundlePEM) }},
		{"other identity", func() error { return s.Save(b.id, a.record, a.chainPEM, a.bundlePEM) }},
		{"no bundle", func() error { return s.Save(a.id, a.record, a.chainPEM, nil) }},
		{"nil identity", func() error { return s.Save(nil, a.record, a.chainPEM, a.bundlePEM) }},
	}
	for _, tt := range tests {
		if err := tt.fn(); err == nil {
			t.Errorf("%s: saved", tt.name)
		}
	}
	if present, _ := s.Present(); len(present) != 0 {
		t.Fatalf("wrote %v", present)
	}
}

// R11.4: --reset --yes moves the identity aside, into a new directory.
func TestMoveAside(t *testing.T) {
	f := newPKI(t)
	s := &Store{Dir: t.TempDir()}
	if _, err := s.MoveAside(t0); !errors.Is(err, ErrNotJoined) {
		t.Fatalf("MoveAside of nothing: %v", err)
	}
	first := f.issue(t, SoftwareKeys{}, "node_01k5x", t0, time.Hour)
	first.save(t, s)
	p1, err := s.MoveAside(t0)
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(s.Dir, "reset-20260301T120000Z"); p1 != want {
		t.Errorf("path %s, want %s", p1, want)
	}
	if mode(t, p1) != 0o700 {
		t.Errorf("mode %04o", mode(t, p1))
	}
	for _, name := range fileNames() {
		if _, err := os.Stat(filepath.Join(p1, name)); err != nil {
			t.Errorf("%s not moved: %v", name, err)
		}
	}
	if _, err := s.Load(); !errors.Is(err, ErrNotJoined) {
		t.Fatalf("after MoveAside: %v", err)
	}
	// The moved identity is intact (a Store over it loads).
	if id, err := (&Store{Dir: p1}).Load(); err != nil || id.Serial != first.id.Serial {
		t.Fatalf("moved identity: %v", err)
	}

	// The next join, reset again within the same second: a new directory.
	f.issue(t, SoftwareKeys{}, "node_01k5z", t0, time.Hour).save(t, s)
	p2, err := s.MoveAside(t0)
	if err != nil || p2 != p1+"-2" {
		t.Fatalf("second MoveAside: %s %v", p2, err)
	}

	// A partial identity is moved as it is.
	write(t, filepath.Join(s.Dir, KeyFile), first.record, 0o600)
	p3, err := s.MoveAside(t0.Add(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(p3, KeyFile)); err != nil {
		t.Fatal(err)
	}

	// A failing rename puts back what moved.
	f.issue(t, SoftwareKeys{}, "node_01k5x", t0, time.Hour).save(t, s)
	n := 0
	s.rename = func(a, b string) error {
		if n == 2 {
			return errors.New("injected")
		}
		n++
		return os.Rename(a, b)
	}
	if _, err := s.MoveAside(t0.Add(2 * time.Second)); err == nil {
		t.Fatal("no error")
	}
	s.rename = nil
	if _, err := s.Load(); err != nil {
		t.Fatalf("after a failed MoveAside: %v", err)
	}
}

// R9.1: a TPM record opens through TPMKeys; software records never need it.
// resetDirs lists the reset-* directories in dir.
func resetDirs(t *testing.T, dir string) []string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(dir, resetPrefix+"*"))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// R11.4: Replace installs the new identity and keeps the old one aside; a
// failure at any step leaves the old identity in place and no reset
// directory.
func TestReplace(t *testing.T) {
	f := newPKI(t)
	t.Run("swaps and keeps the old identity aside", func(t *testing.T) {
		s := &Store{Dir: t.TempDir()}
		old := f.issue(t, SoftwareKeys{}, "node_01k5x", t0, time.Hour)
		old.save(t, s)
		next := f.issue(t, SoftwareKeys{}, "node_01k5z", t0.Add(time.Minute), time.Hour)
		aside, err := s.Replace(t0, next.id, next.record, next.chainPEM, next.bundlePEM)
		if err != nil {
			t.Fatal(err)
		}
		if want := filepath.Join(s.Dir, "reset-20260301T120000Z"); aside != want || mode(t, aside) != 0o700 {
			t.Fatalf("aside %s (%04o), want %s", aside, mode(t, aside), want)
		}
		got, err := s.Load()
		if err != nil || got.Serial != next.id.Serial || got.NodeID != "node_01k5z" {
			t.Fatalf("R11.4: the new identity: %+v %v", got, err)
		}
		kept, err := (&Store{Dir: aside}).Load()
		if err != nil || kept.Serial != old.id.Serial {
			t.Fatalf("R11.4: the old identity kept aside: %v", err)
		}
		if mode(t, filepath.Join(aside, KeyFile)) != 0o600 {
			t.Error("R4.1: the old key aside is not 0600")
		}
		if l := leftovers(t, s.Dir); len(l) != 0 {
			t.Errorf("left %v", l)
		}
	})
	t.Run("no old identity", func(t *testing.T) {
		s := &Store{Dir: filepath.Join(t.TempDir(), "bcd")}
		next := f.issue(t, SoftwareKeys{}, "node_01k5z", t0, time.Hour)
		aside, err := s.Replace(t0, next.id, next.record, next.chainPEM, next.bundlePEM)
		if err != nil || aside != "" {
			t.Fatalf("Replace = %q, %v", aside, err)
		}
		if _, err := s.Load(); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("a damaged old identity is set aside as it is", func(t *testing.T) {
		s := &Store{Dir: t.TempDir()}
		f.issue(t, SoftwareKeys{}, "node_01k5x", t0, time.Hour).save(t, s)
		remove(t, filepath.Join(s.Dir, BundleFile))
		next := f.issue(t, SoftwareKeys{}, "node_01k5z", t0, time.Hour)
		aside, err := s.Replace(t0, next.id, next.record, next.chainPEM, next.bundlePEM)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(filepath.Join(aside, KeyFile)); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(filepath.Join(aside, BundleFile)); err == nil {
			t.Fatal("a file that was not there was set aside")
		}
		if got, err := s.Load(); err != nil || got.NodeID != "node_01k5z" {
			t.Fatalf("%+v %v", got, err)
		}
	})
	for step := range len(fileNames()) {
		t.Run(fmt.Sprintf("rename %d fails", step), func(t *testing.T) {
			s := &Store{Dir: t.TempDir()}
			old := f.issue(t, SoftwareKeys{}, "node_01k5x", t0, time.Hour)
			old.save(t, s)
			n := 0
			s.rename = func(a, b string) error {
				// Until the failing step, the old identity is in place.
				if got, err := (&Store{Dir: s.Dir}).Load(); n == 0 && (err != nil || got.Serial != old.id.Serial) {
					t.Errorf("R11.4: before the first rename the old identity does not load: %v", err)
				}
				if n == step {
					return errors.New("injected")
				}
				n++
				return os.Rename(a, b)
			}
			next := f.issue(t, SoftwareKeys{}, "node_01k5z", t0, time.Hour)
			if _, err := s.Replace(t0, next.id, next.record, next.chainPEM, next.bundlePEM); err == nil || !strings.Contains(err.Error(), "injected") {
				t.Fatalf("Replace: %v", err)
			}
			s.rename = nil
			if got, err := s.Load(); err != nil || got.Serial != old.id.Serial {
				t.Fatalf("R11.4: the old identity after a failed Replace: %v", err)
			}
			if d := resetDirs(t, s.Dir); len(d) != 0 {
				t.Errorf("left %v", d)
			}
			if l := leftovers(t, s.Dir); len(l) != 0 {
				t.Errorf("left %v", l)
			}
		})
	}
	t.Run("an invalid new identity", func(t *testing.T) {
		s := &Store{Dir: t.TempDir()}
		old := f.issue(t, SoftwareKeys{}, "node_01k5x", t0, time.Hour)
		old.save(t, s)
		a, b := f.issue(t, SoftwareKeys{}, "node_01k5z", t0, time.Hour), f.issue(t, SoftwareKeys{}, "node_01k5z", t0, time.Hour)
		if _, err := s.Replace(t0, a.id, b.record, a.chainPEM, a.bundlePEM); err == nil {
			t.Fatal("replaced with a key that is not the certificate's")
		}
		if got, err := s.Load(); err != nil || got.Serial != old.id.Serial {
			t.Fatalf("%v", err)
		}
		if d := resetDirs(t, s.Dir); len(d) != 0 {
			t.Errorf("left %v", d)
		}
	})
}

func TestTPMKeysSeam(t *testing.T) {
	f := newPKI(t)
	tpm := &fakeTPM{}
	s := &Store{Dir: t.TempDir(), TPMKeys: tpm}
	f.issue(t, tpm, "node_01k5x", t0, time.Hour).save(t, s)
	id, err := s.Load()
	if err != nil || id.KeyKind != KindTPM {
		t.Fatalf("Load: %v %+v", err, id)
	}
	if tpm.loads == 0 {
		t.Fatal("TPMKeys not used")
	}
	// Without the TPM the record is refused with a clear message.
	if _, err := (&Store{Dir: s.Dir}).Load(); err == nil || !strings.Contains(err.Error(), "TPM key record") {
		t.Fatalf("without TPM: %v", err)
	}
	// A software identity loads whatever TPMKeys is.
	s2 := &Store{Dir: t.TempDir(), TPMKeys: tpm}
	f.issue(t, SoftwareKeys{}, "node_01k5x", t0, time.Hour).save(t, s2)
	if id, err := s2.Load(); err != nil || id.KeyKind != KindSoftware {
		t.Fatalf("software under a TPM store: %v", err)
	}
}

// fakeTPM stands in for a TPM KeyStore: its record is a TSS2 PEM block
// wrapping the PKCS#8 key (a real one wraps TPM2B_PUBLIC+TPM2B_PRIVATE).
type fakeTPM struct{ loads int }

func (f *fakeTPM) GenerateKey() (crypto.Signer, []byte, error) {
	k, rec, err := SoftwareKeys{}.GenerateKey()
	if err != nil {
		return nil, nil, err
	}
	block, _ := pem.Decode(rec)
	return k, pem.EncodeToMemory(&pem.Block{Type: PEMTypeTPM, Bytes: block.Bytes}), nil
}

func (f *fakeTPM) LoadKey(rec []byte) (crypto.Signer, error) {
	f.loads++
	block, _ := pem.Decode(rec)
	if block == nil || block.Type != PEMTypeTPM {
		return nil, errors.New("not a TPM record")
	}
	return SoftwareKeys{}.LoadKey(pem.EncodeToMemory(&pem.Block{Type: PEMTypeSoftware, Bytes: block.Bytes}))
}

func TestSoftwareKeys(t *testing.T) {
	k, rec, err := SoftwareKeys{}.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	if RecordKind(rec) != KindSoftware || !strings.HasPrefix(string(rec), "-----BEGIN PRIVATE KEY-----") {
		t.Fatalf("R4.1: record %q", rec)
	}
	back, err := SoftwareKeys{}.LoadKey(rec)
	if err != nil || !publicKeyEqual(back.Public(), k.Public()) {
		t.Fatalf("LoadKey: %v", err)
	}
	p384, _ := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	der, _ := x509.MarshalPKCS8PrivateKey(p384)
	tests := []struct {
		name, want string
		rec        []byte
	}{
		{"P-384", "not an ECDSA P-256 key", pem.EncodeToMemory(&pem.Block{Type: PEMTypeSoftware, Bytes: der})},
		{"two blocks", "not a single PEM block", append(append([]byte{}, rec...), rec...)},
		{"garbage", "not a single PEM block", []byte("x")},
		{"EC PRIVATE KEY", `"EC PRIVATE KEY"`, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})},
		{"TPM", "TPM key record", pem.EncodeToMemory(&pem.Block{Type: PEMTypeTPM, Bytes: der})},
	}
	for _, tt := range tests {
		if _, err := (SoftwareKeys{}).LoadKey(tt.rec); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: %v, want %q", tt.name, err, tt.want)
		}
	}
}

// R4.1, R7.2: the CSR is P-256 and carries no names.
func TestNewCSR(t *testing.T) {
	k, _, _ := SoftwareKeys{}.GenerateKey()
	rsaKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	p384, _ := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	tests := []struct {
		name    string
		req     string
		signer  crypto.Signer
		hint    string
		wantErr bool
	}{
		{name: "with hint", req: "R4.1", signer: k, hint: "rack-b7-u12"},
		{name: "no hint", req: "R4.1", signer: k},
		{name: "RSA", req: "R4.1", signer: rsaKey, wantErr: true},
		{name: "P-384", req: "R4.1", signer: p384, wantErr: true},
		{name: "hint with a control character", req: "R7.2", signer: k, hint: "a\nb", wantErr: true},
		{name: "long hint", req: "R7.2", signer: k, hint: strings.Repeat("a", 65), wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			der, err := NewCSR(tt.signer, tt.hint)
			if tt.wantErr {
				if err == nil {
					t.Fatalf("%s: no error", tt.req)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			csr, err := x509.ParseCertificateRequest(der)
			if err != nil {
				t.Fatal(err)
			}
			if len(csr.DNSNames)+len(csr.URIs)+len(csr.IPAddresses)+len(csr.EmailAddresses) != 0 || len(csr.Extensions) != 0 {
				t.Errorf("R7.2: the CSR carries names or extensions")
			}
			if csr.Subject.CommonName != tt.hint || len(csr.Subject.OrganizationalUnit) != 0 {
				t.Errorf("subject %v", csr.Subject)
			}
			pub, err := pki.ParseCSR(der)
			if err != nil || !pub.Equal(k.Public()) {
				t.Fatalf("R4.1: pki.ParseCSR: %v", err)
			}
		})
	}
}

func chmod(t *testing.T, p string, m os.FileMode) {
	t.Helper()
	if err := os.Chmod(p, m); err != nil {
		t.Fatal(err)
	}
}

func remove(t *testing.T, p string) {
	t.Helper()
	if err := os.Remove(p); err != nil {
		t.Fatal(err)
	}
}

func write(t *testing.T, p string, data []byte, m os.FileMode) {
	t.Helper()
	if err := os.WriteFile(p, data, m); err != nil {
		t.Fatal(err)
	}
	chmod(t, p, m)
}
