package ca

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"io"
	"math/big"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// R7.1, R7.2, R7.3, R20.1: the issued certificate's key, lifetime, names
// and role, in both SVID forms.
func TestSignNodeCertProperties(t *testing.T) {
	b := newBundle(t)
	tests := []struct {
		name       string
		role       string
		statements []string
		ttl        time.Duration
		strict     bool
	}{
		{"node", pki.RoleNode, nil, 24 * time.Hour, false},
		{"site", pki.RoleSite, nil, time.Hour, false},
		{"ramdisk", pki.RoleRamdisk, nil, 2 * time.Hour, false},
		{"node-tenant", pki.RoleNodeTenant, nil, 24 * time.Hour, false},
		{"tpm statement", pki.RoleNode, []string{"urn:bc:tpm-ak:sha256:0a1b2c"}, 24 * time.Hour, false},
		{"two statements", pki.RoleNode, []string{"urn:bc:tpm-ak:sha256:0a1b2c", "urn:bc:other:x"}, 24 * time.Hour, false},
		{"strict, no statement", pki.RoleNode, nil, 24 * time.Hour, true},
		{"strict, tpm statement", pki.RoleNode, []string{"urn:bc:tpm-ak:sha256:0a1b2c"}, 24 * time.Hour, true},
		{"strict, two statements", pki.RoleNodeTenant, []string{"urn:bc:tpm-ak:sha256:0a1b2c", "urn:bc:other:x"}, 24 * time.Hour, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			key := newP256(t)
			p := nodeParams()
			p.Role, p.Statements, p.NotAfter = tt.role, tt.statements, p.NotBefore.Add(tt.ttl)
			p.StatementsInExtension = tt.strict
			nc, err := SignNodeCert(b.NodeCA, b.NodeCAKey, newCSR(t, key), p)
			if err != nil {
				t.Fatalf("SignNodeCert: %v", err)
			}
			// crypto/x509 parses it (R7.3).
			cert, err := x509.ParseCertificate(nc.DER)
			if err != nil {
				t.Fatalf("ParseCertificate: %v", err)
			}
			// R7.2: exactly one SPIFFE URI SAN, first; statements after; the
			// CSR's own names are ignored.
			// R20.1: in the strict form the SPIFFE ID is the only one.
			wantURIs := []string{"spiffe://compute.example.com/site/site_01k5w/node/node_01k5x"}
			if !tt.strict {
				wantURIs = append(wantURIs, tt.statements...)
			}
			var gotURIs []string
			spiffeCount := 0
			for _, u := range cert.URIs {
				gotURIs = append(gotURIs, u.String())
				if u.Scheme == "spiffe" {
					spiffeCount++
				}
			}
			if diff := cmp.Diff(wantURIs, gotURIs); diff != "" || spiffeCount != 1 {
				t.Errorf("URIs (-want +got):\n%s (spiffe %d)", diff, spiffeCount)
			}
			if len(cert.DNSNames) != 0 {
				t.Errorf("DNS SANs from the CSR leaked: %v", cert.DNSNames)
			}
			// R7.3: OU=bc-role:<role>, CN=node id.
			if diff := cmp.Diff([]string{"bc-role:" + tt.role}, cert.Subject.OrganizationalUnit); diff != "" {
				t.Errorf("OU (-want +got):\n%s", diff)
			}
			if cert.Subject.CommonName != p.NodeID {
				t.Errorf("CN = %q", cert.Subject.CommonName)
			}
			// R7.1: P-256, the CSR's key, lifetime as given.
			if !pki.IsP256(cert.PublicKey) || !key.PublicKey.Equal(cert.PublicKey) {
				t.Error("certified key is not the CSR's P-256 key")
			}
			if !cert.NotBefore.Equal(p.NotBefore) || !cert.NotAfter.Equal(p.NotAfter) {
				t.Errorf("validity %v..%v, want %v..%v", cert.NotBefore, cert.NotAfter, p.NotBefore, p.NotAfter)
			}
			// R20.1: X.509-SVID 4.4 wants both usages when the extension is
			// present.
			if cert.IsCA || !slices.Equal(cert.ExtKeyUsage, []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}) {
				t.Errorf("IsCA %v EKU %v", cert.IsCA, cert.ExtKeyUsage)
			}
			if cert.SerialNumber.BitLen() > 128 || cert.SerialNumber.Sign() <= 0 {
				t.Errorf("serial %v", cert.SerialNumber)
			}
			if nc.Serial != cert.SerialNumber.Text(16) || len(nc.SPKISHA256) != 32 || hex.EncodeToString(nc.SPKISHA256) != hex.EncodeToString(pki.SPKIHash(cert)) {
				t.Errorf("Serial %q SPKI %x", nc.Serial, nc.SPKISHA256)
			}
			// It chains to the node CA for client and for server auth.
			roots := x509.NewCertPool()
			roots.AddCert(b.NodeCA)
			for _, use := range []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth} {
				if _, err := cert.Verify(x509.VerifyOptions{Roots: roots, CurrentTime: t0.Add(time.Minute), KeyUsages: []x509.ExtKeyUsage{use}}); err != nil {
					t.Errorf("Verify for %v: %v", use, err)
				}
			}
			// ParseNodeCert reads back what was asked for.
			id, err := pki.ParseNodeCert(nc.DER)
			if err != nil {
				t.Fatalf("ParseNodeCert: %v", err)
			}
			want := pki.NodeIdentity{TrustDomain: testTD, SiteID: p.SiteID, NodeID: p.NodeID, Role: tt.role, Statements: tt.statements}
			if diff := cmp.Diff(want, id); diff != "" {
				t.Errorf("identity (-want +got):\n%s", diff)
			}
			if id.SPIFFEID() != wantURIs[0] || pki.SPIFFEID(testTD, p.SiteID, p.NodeID) != wantURIs[0] {
				t.Errorf("SPIFFEID = %q", id.SPIFFEID())
			}
			// go-spiffe accepts it as an X509-SVID. The SVID spec allows one
			// URI SAN only, so a page-form certificate with statements is not
			// an SVID to go-spiffe (ParseNodeCert is the parser for those);
			// the strict form is (R20.1).
			td := spiffeid.RequireTrustDomainFromString(testTD)
			_, _, err = x509svid.ParseAndVerify([][]byte{nc.DER}, x509bundle.FromX509Authorities(td, []*x509.Certificate{b.NodeCA}), x509svid.WithTime(t0.Add(time.Minute)))
			if len(tt.statements) == 0 || tt.strict {
				if err != nil {
					t.Errorf("x509svid.ParseAndVerify: %v", err)
				}
				if sid, err := x509svid.IDFromCert(cert); err != nil || sid.String() != wantURIs[0] {
					t.Errorf("x509svid.IDFromCert = %v, %v", sid, err)
				}
			} else if err == nil {
				t.Error("x509svid accepted a certificate with more than one URI SAN")
			}
		})
	}
}

// R4.1, R7.1: the CSR must be well signed and hold a P-256 key.
func TestSignNodeCertCSRRefusals(t *testing.T) {
	b := newBundle(t)
	badSig := newCSR(t, newP256(t))
	badSig[len(badSig)-3] ^= 0x55
	rsaKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	p384, _ := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	_, edKey, _ := ed25519.GenerateKey(rand.Reader)
	tests := []struct {
		name string
		csr  []byte
		msg  string
	}{
		{"bad signature", badSig, "the signature does not verify"},
		{"RSA", newCSR(t, rsaKey), "ECDSA P-256"},
		{"P-384", newCSR(t, p384), "ECDSA P-256"},
		{"Ed25519", newCSR(t, edKey), "ECDSA P-256"},
		{"garbage", []byte("not a csr"), "not a PKCS#10 request"},
		{"empty", nil, "size"},
		{"huge", make([]byte, 17<<10), "size"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := SignNodeCert(b.NodeCA, b.NodeCAKey, tt.csr, nodeParams())
			e, ok := errs.As(err)
			if !ok || e.Code != errs.InvalidArgument || e.Field != "csr" || !strings.Contains(e.Message, tt.msg) {
				t.Errorf("err = %v, want INVALID_ARGUMENT csr %q", err, tt.msg)
			}
		})
	}
}

// SignNodeCertKey signs for a key ParseCSR already checked, and refuses a
// key that is not P-256 (or none).
func TestSignNodeCertKey(t *testing.T) {
	b := newBundle(t)
	key := newP256(t)
	pub, err := pki.ParseCSR(newCSR(t, key))
	if err != nil {
		t.Fatal(err)
	}
	nc, err := SignNodeCertKey(b.NodeCA, b.NodeCAKey, pub, nodeParams())
	if err != nil {
		t.Fatalf("SignNodeCertKey: %v", err)
	}
	if !key.Public().(*ecdsa.PublicKey).Equal(nc.Cert.PublicKey) {
		t.Error("the certificate is not for the CSR's key")
	}
	if err := nc.Cert.CheckSignatureFrom(b.NodeCA); err != nil {
		t.Errorf("the node CA's signature does not verify: %v", err)
	}
	p384, _ := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	for name, k := range map[string]*ecdsa.PublicKey{"nil": nil, "P-384": &p384.PublicKey} {
		_, err := SignNodeCertKey(b.NodeCA, b.NodeCAKey, k, nodeParams())
		if e, ok := errs.As(err); !ok || e.Code != errs.InvalidArgument || e.Field != "csr" {
			t.Errorf("%s key: err = %v, want INVALID_ARGUMENT csr", name, err)
		}
	}
}

// R7.1, R7.2, R7.3: parameters outside policy are refused.
func TestSignNodeCertParamRefusals(t *testing.T) {
	b := newBundle(t)
	csr := newCSR(t, newP256(t))
	tests := []struct {
		name  string
		edit  func(*NodeCertParams)
		field string
	}{
		{"unknown role", func(p *NodeCertParams) { p.Role = "admin" }, "role"},
		{"empty role", func(p *NodeCertParams) { p.Role = "" }, "role"},
		{"bad trust domain", func(p *NodeCertParams) { p.TrustDomain = "Bad TD" }, "trustDomain"},
		{"slash in node", func(p *NodeCertParams) { p.NodeID = "a/b" }, "nodeId"},
		{"dot-dot site", func(p *NodeCertParams) { p.SiteID = ".." }, "nodeId"},
		{"empty node", func(p *NodeCertParams) { p.NodeID = "" }, "nodeId"},
		{"spiffe statement", func(p *NodeCertParams) { p.Statements = []string{"spiffe://compute.example.com/x"} }, "statements"},
		{"bare prefix", func(p *NodeCertParams) { p.Statements = []string{"urn:bc:"} }, "statements"},
		{"space", func(p *NodeCertParams) { p.Statements = []string{"urn:bc:a b"} }, "statements"},
		{"duplicate", func(p *NodeCertParams) { p.Statements = []string{"urn:bc:a", "urn:bc:a"} }, "statements"},
		{"too long", func(p *NodeCertParams) { p.NotAfter = p.NotBefore.Add(24*time.Hour + time.Second) }, "notAfter"},
		{"ramdisk too long", func(p *NodeCertParams) { p.Role = pki.RoleRamdisk; p.NotAfter = p.NotBefore.Add(3 * time.Hour) }, "notAfter"},
		{"inverted", func(p *NodeCertParams) { p.NotAfter = p.NotBefore.Add(-time.Hour) }, "notAfter"},
		{"zero times", func(p *NodeCertParams) { p.NotBefore, p.NotAfter = time.Time{}, time.Time{} }, "notAfter"},
		{"before the CA", func(p *NodeCertParams) { p.NotBefore = t0.Add(-time.Hour); p.NotAfter = t0 }, "notAfter"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := nodeParams()
			tt.edit(&p)
			_, err := SignNodeCert(b.NodeCA, b.NodeCAKey, csr, p)
			e, ok := errs.As(err)
			if !ok || e.Code != errs.InvalidArgument || e.Field != tt.field {
				t.Errorf("err = %v, want INVALID_ARGUMENT on %s", err, tt.field)
			}
		})
	}
}

// R7.2, R7.3: ParseNodeCert refuses certificates that are not node
// certificates, however they were signed.
func TestParseNodeCertRefusals(t *testing.T) {
	b := newBundle(t)
	spiffeURI := "spiffe://compute.example.com/site/s1/node/n1"
	base := func() *x509.Certificate {
		return &x509.Certificate{
			SerialNumber:          big.NewInt(7),
			Subject:               pkix.Name{CommonName: "n1", OrganizationalUnit: []string{"bc-role:node"}},
			NotBefore:             t0,
			NotAfter:              t0.Add(time.Hour),
			KeyUsage:              x509.KeyUsageDigitalSignature,
			ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
			BasicConstraintsValid: true,
			URIs:                  []*url.URL{mustURL(t, spiffeURI)},
		}
	}
	tests := []struct {
		name string
		edit func(*x509.Certificate)
		key  crypto.Signer
		msg  string
	}{
		{"valid", func(*x509.Certificate) {}, nil, ""},
		{"no URI", func(c *x509.Certificate) { c.URIs = nil }, nil, "no URI SAN"},
		{"statement first", func(c *x509.Certificate) { c.URIs = []*url.URL{mustURL(t, "urn:bc:x"), mustURL(t, spiffeURI)} }, nil, "not a SPIFFE ID"},
		{"two SPIFFE IDs", func(c *x509.Certificate) {
			c.URIs = []*url.URL{mustURL(t, spiffeURI), mustURL(t, "spiffe://compute.example.com/site/s1/node/n2")}
		}, nil, "not a urn:bc: statement"},
		{"https URI", func(c *x509.Certificate) { c.URIs = append(c.URIs, mustURL(t, "https://example.com")) }, nil, "not a urn:bc: statement"},
		{"not a node path", func(c *x509.Certificate) { c.URIs = []*url.URL{mustURL(t, "spiffe://compute.example.com/site/s1")} }, nil, "not a node ID"},
		{"extra segment", func(c *x509.Certificate) { c.URIs = []*url.URL{mustURL(t, spiffeURI+"/x")} }, nil, "not a node ID"},
		{"no OU", func(c *x509.Certificate) { c.Subject.OrganizationalUnit = nil }, nil, "exactly one subject OU"},
		{"two OUs", func(c *x509.Certificate) { c.Subject.OrganizationalUnit = []string{"bc-role:node", "bc-role:site"} }, nil, "exactly one subject OU"},
		{"unknown role", func(c *x509.Certificate) { c.Subject.OrganizationalUnit = []string{"bc-role:root"} }, nil, "is not a role"},
		{"DNS SAN", func(c *x509.Certificate) { c.DNSNames = []string{"x.example.com"} }, nil, "unexpected DNS"},
		{"server only", func(c *x509.Certificate) { c.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth} }, nil, "clientAuth"},
		{"CA", func(c *x509.Certificate) { c.IsCA = true; c.KeyUsage |= x509.KeyUsageCertSign }, nil, "CA certificate"},
		{"P-384 key", func(*x509.Certificate) {}, mustP384(t), "not ECDSA P-256"},
		// R20.1: the SPIFFE-strict form.
		{"strict form", func(c *x509.Certificate) {
			c.ExtraExtensions = []pkix.Extension{stmtExt(t, false, "urn:bc:tpm-ak:sha256:00")}
		}, nil, ""},
		{"strict form beside a statement SAN", func(c *x509.Certificate) {
			c.URIs = append(c.URIs, mustURL(t, "urn:bc:x"))
			c.ExtraExtensions = []pkix.Extension{stmtExt(t, false, "urn:bc:tpm-ak:sha256:00")}
		}, nil, "beside further URI SANs"},
		{"critical statements extension", func(c *x509.Certificate) { c.ExtraExtensions = []pkix.Extension{stmtExt(t, true, "urn:bc:x")} }, nil, "critical"},
		{"two statements extensions", func(c *x509.Certificate) {
			c.ExtraExtensions = []pkix.Extension{stmtExt(t, false, "urn:bc:x"), stmtExt(t, false, "urn:bc:y")}
		}, nil, "duplicate extension"},
		{"empty statements extension", func(c *x509.Certificate) { c.ExtraExtensions = []pkix.Extension{stmtExt(t, false)} }, nil, "holds 0 statements"},
		{"not a statement in the extension", func(c *x509.Certificate) {
			c.ExtraExtensions = []pkix.Extension{{Id: pki.OIDNodeStatements, Value: []byte{0x30, 0x07, 0x16, 0x05, 'h', 't', 't', 'p', ':'}}}
		}, nil, "not a urn:bc: statement"},
		{"garbage statements extension", func(c *x509.Certificate) {
			c.ExtraExtensions = []pkix.Extension{{Id: pki.OIDNodeStatements, Value: []byte{0x04, 0x00}}}
		}, nil, "not a SEQUENCE"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tmpl := base()
			tt.edit(tmpl)
			var pub crypto.PublicKey = newP256(t).Public()
			if tt.key != nil {
				pub = tt.key.Public()
			}
			der, err := x509.CreateCertificate(rand.Reader, tmpl, b.NodeCA, pub, b.NodeCAKey)
			if err != nil {
				t.Fatal(err)
			}
			_, err = pki.ParseNodeCert(der)
			if tt.msg == "" {
				if err != nil {
					t.Errorf("ParseNodeCert: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.msg) {
				t.Errorf("err = %v, want %q", err, tt.msg)
			}
		})
	}
}

// stmtExt is a statements extension (pki.OIDNodeStatements) holding
// statements.
func stmtExt(t *testing.T, critical bool, statements ...string) pkix.Extension {
	t.Helper()
	v, err := pki.MarshalNodeStatements(statements)
	if err != nil {
		t.Fatal(err)
	}
	return pkix.Extension{Id: pki.OIDNodeStatements, Critical: critical, Value: v}
}

func mustURL(t *testing.T, s string) *url.URL {
	t.Helper()
	u, err := url.Parse(s)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// A signer that is not the node CA's key, or a CA that is not P-256, is
// refused before anything is signed.
func TestSignNodeCertWrongCAKey(t *testing.T) {
	b := newBundle(t)
	other := newBundle(t)
	key := newP256(t)
	if _, err := SignNodeCertKey(b.NodeCA, other.NodeCAKey, &key.PublicKey, nodeParams()); err == nil {
		t.Error("signed with a key that is not the node CA's")
	}
	ca := *b.NodeCA
	ca.PublicKey = mustP384(t).Public()
	if _, err := SignNodeCertKey(&ca, b.NodeCAKey, &key.PublicKey, nodeParams()); err == nil {
		t.Error("signed for a CA whose key is not P-256")
	}
}

// faultySigner is the node CA's key returning another key's signature.
type faultySigner struct {
	crypto.Signer
	other crypto.Signer
}

func (f faultySigner) Sign(r io.Reader, digest []byte, o crypto.SignerOpts) ([]byte, error) {
	return f.other.Sign(r, digest, o)
}

// x509.CreateCertificate's check of its own signature catches a signer
// that returns a bad one.
func TestSignNodeCertFaultySigner(t *testing.T) {
	b := newBundle(t)
	key := newP256(t)
	s := faultySigner{Signer: b.NodeCAKey, other: newP256(t)}
	if _, err := SignNodeCertKey(b.NodeCA, s, &key.PublicKey, nodeParams()); err == nil || !strings.Contains(err.Error(), "signature") {
		t.Errorf("err = %v, want the signature refused", err)
	}
}

func mustP384(t *testing.T) crypto.Signer {
	k, err := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func BenchmarkSignNodeCert(b *testing.B) {
	bundle := newBundle(b)
	csr := newCSR(b, newP256(b))
	p := nodeParams()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := SignNodeCert(bundle.NodeCA, bundle.NodeCAKey, csr, p); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkSignNodeCertKey(b *testing.B) {
	bundle := newBundle(b)
	pub, err := pki.ParseCSR(newCSR(b, newP256(b)))
	if err != nil {
		b.Fatal(err)
	}
	p := nodeParams()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := SignNodeCertKey(bundle.NodeCA, bundle.NodeCAKey, pub, p); err != nil {
			b.Fatal(err)
		}
	}
}
