package tpmverify_test

import (
	"bytes"
	"crypto/rand"
	"testing"
	"time"

	"github.com/google/go-tpm/tpm2"

	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/tpmdevice"
	"github.com/better-compute/better-compute/internal/node/tpmdevice/tpmtest"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/tpmverify"
)

// certified makes a key from tmpl in tp, a CSR for it, and the AK's
// certify over the hash of certifyCSR (the CSR itself when nil).
func certified(t *testing.T, tp *tpmdevice.TPM, tmpl tpm2.TPMTPublic, certifyCSR []byte) (*tpmverify.KeyAttestation, []byte) {
	t.Helper()
	k, err := tp.CreateKey(tmpl)
	if err != nil {
		t.Fatal(err)
	}
	csr, err := identity.NewCSR(k, "")
	if err != nil {
		t.Fatal(err)
	}
	if certifyCSR == nil {
		certifyCSR = csr
	}
	att, err := tp.Certify(k, pki.CSRHash(certifyCSR))
	if err != nil {
		t.Fatal(err)
	}
	b, err := att.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	a, err := tpmverify.ParseKeyAttestation(b)
	if err != nil {
		t.Fatal(err)
	}
	return a, csr
}

// R9.2, R13.3: a certify is accepted only for a fixedTPM key of the CSR,
// over that CSR, signed by the AK it names; each failure has its reason.
func TestVerify(t *testing.T) {
	sim := tpmtest.Start(t)
	tp := sim.Open(t)
	other := tpmtest.StartFresh(t).Open(t)
	ak, err := tp.AK()
	if err != nil {
		t.Fatal(err)
	}
	notFixed := tpmdevice.NodeKeyTemplate
	notFixed.ObjectAttributes.FixedTPM, notFixed.ObjectAttributes.FixedParent = false, false

	for _, tc := range []struct {
		name   string
		make   func(t *testing.T) (*tpmverify.KeyAttestation, []byte)
		reason string
	}{
		{"good", func(t *testing.T) (*tpmverify.KeyAttestation, []byte) {
			return certified(t, tp, tpmdevice.NodeKeyTemplate, nil)
		}, ""},
		{"node key not fixedTPM", func(t *testing.T) (*tpmverify.KeyAttestation, []byte) {
			return certified(t, tp, notFixed, nil)
		}, tpmverify.ReasonNodeKeyNotFixedTPM},
		{"certify over another CSR", func(t *testing.T) (*tpmverify.KeyAttestation, []byte) {
			return certified(t, tp, tpmdevice.NodeKeyTemplate, []byte("another csr"))
		}, tpmverify.ReasonCertifyCSR},
		{"another AK named", func(t *testing.T) (*tpmverify.KeyAttestation, []byte) {
			a, csr := certified(t, tp, tpmdevice.NodeKeyTemplate, nil)
			oak, err := other.AK()
			if err != nil {
				t.Fatal(err)
			}
			a.AK = &oak.Public
			return a, csr
		}, tpmverify.ReasonCertifySignature},
		{"CSR of another key", func(t *testing.T) (*tpmverify.KeyAttestation, []byte) {
			// A certify of one key over the CSR of another.
			_, csr := certified(t, tp, tpmdevice.NodeKeyTemplate, nil)
			k, err := tp.CreateKey(tpmdevice.NodeKeyTemplate)
			if err != nil {
				t.Fatal(err)
			}
			att, err := tp.Certify(k, pki.CSRHash(csr))
			if err != nil {
				t.Fatal(err)
			}
			raw, _ := att.Marshal()
			a, err := tpmverify.ParseKeyAttestation(raw)
			if err != nil {
				t.Fatal(err)
			}
			return a, csr
		}, tpmverify.ReasonNodeKeyCSR},
		{"certified name of another key", func(t *testing.T) (*tpmverify.KeyAttestation, []byte) {
			a, csr := certified(t, tp, tpmdevice.NodeKeyTemplate, nil)
			b, _ := certified(t, tp, tpmdevice.NodeKeyTemplate, nil)
			a.Key = b.Key
			return a, csr
		}, tpmverify.ReasonNodeKeyName},
		{"tampered certify", func(t *testing.T) (*tpmverify.KeyAttestation, []byte) {
			a, csr := certified(t, tp, tpmdevice.NodeKeyTemplate, nil)
			a.CertifyInfo = bytes.Clone(a.CertifyInfo)
			a.CertifyInfo[len(a.CertifyInfo)-1] ^= 1
			return a, csr
		}, tpmverify.ReasonCertifySignature},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, csr := tc.make(t)
			key, err := pki.ParseCSR(csr)
			if err != nil {
				t.Fatal(err)
			}
			name, err := tpmverify.Verify(a, csr, key)
			if got := tpmverify.ReasonOf(err); got != tc.reason || (tc.reason != "") != (err != nil) {
				t.Fatalf("reason %q (%v), want %q", got, err, tc.reason)
			}
			if err == nil && !bytes.Equal(name, ak.Name) {
				t.Fatal("Verify returned another AK name")
			}
		})
	}
}

// R9.2: EKs are trusted by a manufacturer CA or by hash; the P-256 EK has
// no certificate; a TPM from another manufacturer CA is unknown; every EK
// kind activates the server's credential.
func TestEKTrustAndCredential(t *testing.T) {
	sim := tpmtest.Start(t)
	tp := sim.Open(t)
	fresh := tpmtest.StartFresh(t)
	cas, err := tpmverify.LoadCAs(sim.CAFiles)
	if err != nil {
		t.Fatal(err)
	}
	ak, err := tp.AK()
	if err != nil {
		t.Fatal(err)
	}
	p256, err := tp.EK(tpmdevice.EKP256)
	if err != nil {
		t.Fatal(err)
	}
	p256Hash, _ := tpmverify.EKHash(&p256.Public)
	trust := &tpmverify.Trust{CAs: cas, EKHashes: [][]byte{p256Hash}}
	now := time.Now()
	for _, kind := range []tpmdevice.EKKind{tpmdevice.EKRSA2048, tpmdevice.EKP384, tpmdevice.EKP256} {
		t.Run(string(kind), func(t *testing.T) {
			ek, err := tp.EK(kind)
			if err != nil {
				t.Fatal(err)
			}
			pub, err := tpmverify.ParseEK(ek.PublicBytes())
			if err != nil {
				t.Fatal(err)
			}
			ok, err := trust.Trusted(pub, ek.Cert, now)
			if !ok || err != nil {
				t.Fatalf("trusted = %v, %v", ok, err)
			}
			secret := []byte("the secret the TPM must recover!")
			blob, enc, err := tpmverify.MakeCredential(rand.Reader, pub, ak.Name, secret)
			if err != nil {
				t.Fatal(err)
			}
			got, err := tp.ActivateCredential(kind, blob, enc)
			if err != nil || !bytes.Equal(got, secret) {
				t.Fatalf("activate: %v", err)
			}
		})
	}
	// Another CA's TPM is unknown; its certificate for another key is an
	// error.
	ftp := fresh.Open(t)
	fek, err := ftp.EK(tpmdevice.EKRSA2048)
	if err != nil {
		t.Fatal(err)
	}
	fpub, _ := tpmverify.ParseEK(fek.PublicBytes())
	if ok, err := trust.Trusted(fpub, fek.Cert, now); ok || err != nil {
		t.Fatalf("another manufacturer's EK: %v, %v", ok, err)
	}
	rsa, _ := tp.EK(tpmdevice.EKRSA2048)
	if _, err := trust.Trusted(fpub, rsa.Cert, now); tpmverify.ReasonOf(err) != tpmverify.ReasonEKCertKey {
		t.Fatalf("certificate of another EK: %v", err)
	}
	// Keys that are not EKs.
	if _, err := tpmverify.ParseEK(ak.PublicBytes()); tpmverify.ReasonOf(err) != tpmverify.ReasonEKInvalid {
		t.Fatalf("AK as EK: %v", err)
	}
}

// R7.2: the statement names the AK's TPM name, and parses back.
func TestStatement(t *testing.T) {
	name := append([]byte{0x00, 0x0b}, bytes.Repeat([]byte{0xab}, 32)...)
	s, err := tpmverify.Statement(name)
	if err != nil {
		t.Fatal(err)
	}
	if want := "urn:bc:tpm-ak:sha256:" + string(bytes.Repeat([]byte("ab"), 32)); s != want {
		t.Fatalf("%s, want %s", s, want)
	}
	back, ok := tpmverify.ParseStatement(s)
	if !ok || !bytes.Equal(back, name) {
		t.Fatal("statement does not parse back")
	}
	for _, bad := range []string{"urn:bc:tpm-ak:sha256:ab", "urn:bc:tpm-ak:md5:" + string(bytes.Repeat([]byte("ab"), 32)), "urn:bc:tpm-ak:sha256:" + string(bytes.Repeat([]byte("AB"), 32)), "urn:bc:other"} {
		if _, ok := tpmverify.ParseStatement(bad); ok {
			t.Errorf("%q parsed", bad)
		}
	}
}
