package tpmdevice_test

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"testing"

	"github.com/google/go-tpm/tpm2"

	"github.com/better-compute/better-compute/internal/node/tpmdevice"
	"github.com/better-compute/better-compute/internal/node/tpmdevice/tpmtest"
)

// transients counts the TPM's loaded transient objects.
func transients(t *testing.T, tp *tpmdevice.TPM) int {
	t.Helper()
	n, err := tp.TransientHandles()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// R9.1, R9.2: the three EK kinds, each activating a credential made for
// it and the AK, and leaving no object loaded.
func TestEKsActivateCredential(t *testing.T) {
	sim := tpmtest.Start(t)
	tp := sim.Open(t)
	ak, err := tp.AK()
	if err != nil {
		t.Fatal(err)
	}
	ak2, err := tp.AK()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(ak.Name, ak2.Name) {
		t.Fatal("the AK is not deterministic")
	}
	for _, tc := range []struct {
		kind     tpmdevice.EKKind
		wantCert bool
	}{{tpmdevice.EKRSA2048, true}, {tpmdevice.EKP384, true}, {tpmdevice.EKP256, false}} {
		t.Run(string(tc.kind), func(t *testing.T) {
			ek, err := tp.EK(tc.kind)
			if err != nil {
				t.Fatal(err)
			}
			if got := tpmdevice.KindOf(&ek.Public); got != tc.kind {
				t.Fatalf("kind %q", got)
			}
			if (len(ek.Cert) > 0) != tc.wantCert {
				t.Fatalf("certificate present = %v", len(ek.Cert) > 0)
			}
			if tc.wantCert {
				c, err := x509.ParseCertificate(ek.Cert)
				if err != nil {
					t.Fatal(err)
				}
				pub, _ := tpm2.Pub(ek.Public)
				if !c.PublicKey.(interface{ Equal(crypto.PublicKey) bool }).Equal(pub) {
					t.Fatal("the EK certificate is for another key")
				}
			}
			enc, err := tpm2.ImportEncapsulationKey(&ek.Public)
			if err != nil {
				t.Fatal(err)
			}
			secret := []byte("0123456789abcdef0123456789abcdef")
			blob, encSecret, err := tpm2.CreateCredential(rand.Reader, enc, ak.Name, secret)
			if err != nil {
				t.Fatal(err)
			}
			got, err := tp.ActivateCredential(tc.kind, blob, encSecret)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, secret) {
				t.Fatal("activated another secret")
			}
			if n := transients(t, tp); n != 0 {
				t.Fatalf("%d transient objects left loaded", n)
			}
		})
	}
	def, err := tp.DefaultEK()
	if err != nil || def.Kind != tpmdevice.EKRSA2048 {
		t.Fatalf("default EK %v, %v", def, err)
	}
}

// R9.1: a node key signs in the TPM, certifies with qualifying data, and
// its record reloads after the TPM restarts.
func TestNodeKeySignCertifyReload(t *testing.T) {
	sim := tpmtest.Start(t)
	tp := sim.Open(t)
	k, err := tp.NewNodeKey()
	if err != nil {
		t.Fatal(err)
	}
	digest := sha256.Sum256([]byte("csr"))
	sig, err := k.Sign(rand.Reader, digest[:], crypto.SHA256)
	if err != nil {
		t.Fatal(err)
	}
	if !ecdsa.VerifyASN1(k.Public().(*ecdsa.PublicKey), digest[:], sig) {
		t.Fatal("the TPM signature does not verify")
	}
	att, err := tp.Certify(k, digest[:])
	if err != nil {
		t.Fatal(err)
	}
	info, err := tpm2.Unmarshal[tpm2.TPMSAttest](att.CertifyInfo)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(info.ExtraData.Buffer, digest[:]) {
		t.Fatal("certify lost the qualifying data")
	}
	rec, err := k.Record()
	if err != nil {
		t.Fatal(err)
	}
	if n := transients(t, tp); n != 0 {
		t.Fatalf("%d transient objects left loaded", n)
	}

	_ = tp.Close()
	sim.Restart(t)
	tp = sim.Open(t)
	k2, err := tp.LoadKey(rec)
	if err != nil {
		t.Fatal(err)
	}
	if !k2.Public().(*ecdsa.PublicKey).Equal(k.Public()) {
		t.Fatal("reloaded another key")
	}
	sig, err = k2.Sign(rand.Reader, digest[:], crypto.SHA256)
	if err != nil || !ecdsa.VerifyASN1(k.Public().(*ecdsa.PublicKey), digest[:], sig) {
		t.Fatalf("sign after restart: %v", err)
	}

	// Another TPM cannot load the record.
	other := tpmtest.StartFresh(t).Open(t)
	if _, err := other.LoadKey(rec); err == nil {
		t.Fatal("another TPM loaded the record")
	}
}
