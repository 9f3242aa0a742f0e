package certfile_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/shared/certfile"
)

func selfSigned(t *testing.T, cn string) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature, DNSNames: []string{"example.test"}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder})
}

func write(t *testing.T, path string, data []byte) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// R16.1: a certificate pair written over is served from the next look on;
// a replacement that does not load leaves the last good one in force.
func TestPairReloadsR16_1(t *testing.T) {
	dir := t.TempDir()
	crt, key := filepath.Join(dir, "gw.crt"), filepath.Join(dir, "gw.key")
	c1, k1 := selfSigned(t, "one")
	write(t, crt, c1)
	write(t, key, k1)
	p, err := certfile.LoadPair(crt, key, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if p.Get().Leaf.Subject.CommonName != "one" {
		t.Fatal("not the loaded pair")
	}
	// The certificate lands before its key: the mismatched pair does not
	// load, and the pair is served once both are there.
	c2, k2 := selfSigned(t, "two")
	write(t, crt, c2)
	p.Get()
	write(t, key, k2)
	poll.Until(t, 10*time.Second, "the new pair served", func() bool { return p.Get().Leaf.Subject.CommonName == "two" })

	check := func(c *tls.Certificate) error {
		if c.Leaf.Subject.CommonName == "bad" {
			return os.ErrInvalid
		}
		return nil
	}
	if _, err := certfile.LoadPair(crt, key, check, nil); err != nil {
		t.Fatal(err)
	}
	c3, k3 := selfSigned(t, "bad")
	write(t, crt, c3)
	write(t, key, k3)
	if _, err := certfile.LoadPair(crt, key, check, nil); err == nil {
		t.Fatal("a pair the check refuses loaded")
	}
}

// R16.1: a CA file that gains a CA verifies servers of both from the next
// look on.
func TestPoolReloadsR16_1(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "ca.pem")
	c1, _ := selfSigned(t, "ca one")
	c2, _ := selfSigned(t, "ca two")
	write(t, file, c1)
	p, err := certfile.LoadPool(file, nil)
	if err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode(c2)
	second, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	cs := tls.ConnectionState{PeerCertificates: []*x509.Certificate{second}, ServerName: "example.test"}
	if certfile.VerifyServer(cs, p.Get()) == nil {
		t.Fatal("a CA not in the file verified")
	}
	write(t, file, []byte("not pem"))
	write(t, file, append(append([]byte{}, c1...), c2...))
	poll.Until(t, 10*time.Second, "the second CA trusted", func() bool { return certfile.VerifyServer(cs, p.Get()) == nil })
}
