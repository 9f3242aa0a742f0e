package join_test

import (
	"bytes"
	"context"
	"crypto"
	"crypto/x509"
	"encoding/hex"
	"testing"
	"time"

	"github.com/google/go-tpm/tpm2"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/jointoken"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/tpm"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/tpmdevice"
	"github.com/better-compute/better-compute/internal/node/tpmdevice/tpmtest"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/hwid"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/tpmverify"
)

// tpmEnv is a JoinService running the tpm attestor against real swtpm.
type tpmEnv struct {
	f   *fixture
	clk *clock.Fake
	svc *join.Service
	sim *tpmtest.Sim
	tp  *tpmdevice.TPM
}

var tpmMachines = 500

func newTPMEnv(t testing.TB, f *fixture, pools func(sim *tpmtest.Sim, tp *tpmdevice.TPM) []tpm.Pool) *tpmEnv {
	t.Helper()
	return newTPMEnvWith(t, f, pools, nil)
}

// newTPMEnvWith is newTPMEnv with mod applied to JoinService's config.
func newTPMEnvWith(t testing.TB, f *fixture, pools func(sim *tpmtest.Sim, tp *tpmdevice.TPM) []tpm.Pool, mod func(*join.Config)) *tpmEnv {
	t.Helper()
	sim := tpmtest.Start(t)
	tp := sim.Open(t)
	clk := clock.NewFake(time.Now())
	core, err := nodeident.New(nodeident.Config{DB: f.e.DB, Bundle: f.e.Bundle, Clock: clk,
		Limiter: events.NewLimiter(clk, 1000, time.Minute), Hub: f.e.Server.Hub()})
	if err != nil {
		t.Fatal(err)
	}
	ta, err := tpm.New(tpm.Config{Pools: pools(sim, tp), ChallengeKey: bytes.Repeat([]byte{7}, 32), Clock: clk})
	if err != nil {
		t.Fatal(err)
	}
	reg, err := attest.NewRegistry(jointoken.New(), ta)
	if err != nil {
		t.Fatal(err)
	}
	cfg := join.Config{DB: f.e.DB, Core: core, Attestors: reg, Clock: clk, Hub: f.e.Server.Hub()}
	if mod != nil {
		mod(&cfg)
	}
	svc, err := join.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return &tpmEnv{f: f, clk: clk, svc: svc, sim: sim, tp: tp}
}

// tpmReq is a tpm join as bcd makes it, with hooks to break one part.
type tpmReq struct {
	kind      tpmdevice.EKKind
	template  tpm2.TPMTPublic
	certifyOf []byte         // the CSR the certify is over (nil: the request's)
	certifyBy *tpmdevice.TPM // the TPM whose AK certifies (nil: this one)
	answer    func([]byte) []byte
	// role is the role the machine asks for and signs ("": none).
	role string
	// unsigned leaves request_sig out, as a bcd before R15.1 did.
	unsigned bool
	// relay, when set, changes what reaches JoinService on each leg (1,
	// 2): the machine's own request, and its signature, stay as made.
	relay func(leg int, req *agentv1.JoinRequest)
	// peer is the address the gateway saw ("": 192.0.2.9:1).
	peer string
	// claims are the machine's claims (nil: claims of a new machine).
	claims *agentv1.Claims
}

// join runs both legs and returns the answer and the node key.
func (e *tpmEnv) join(t *testing.T, r tpmReq) (*agentv1.JoinResponse, *tpmdevice.Key, error) {
	t.Helper()
	if r.template.Type == 0 {
		r.template = tpmdevice.NodeKeyTemplate
	}
	key, err := e.tp.CreateKey(r.template)
	if err != nil {
		t.Fatal(err)
	}
	csr, err := identity.NewCSR(key, "")
	if err != nil {
		t.Fatal(err)
	}
	of := r.certifyOf
	if of == nil {
		of = csr
	}
	by := r.certifyBy
	if by == nil {
		by = e.tp
	}
	certKey := key
	if by != e.tp {
		// Another TPM certifies a key of its own over this CSR.
		if certKey, err = by.NewNodeKey(); err != nil {
			t.Fatal(err)
		}
	}
	att, err := by.Certify(certKey, pki.CSRHash(of))
	if err != nil {
		t.Fatal(err)
	}
	ka, _ := att.Marshal()
	ek, err := e.tp.EK(r.kind)
	if err != nil {
		t.Fatal(err)
	}
	ev, _ := proto.Marshal(&agentv1.TPMEvidence{EkPublic: ek.PublicBytes(), EkCertificate: ek.Cert})
	tpmMachines++
	claims := r.claims
	if claims == nil {
		claims = jointest.Claims(tpmMachines)
	}
	req := &agentv1.JoinRequest{Csr: csr, Claims: claims, Attestor: tpm.Name, Protocol: 1, Evidence: ev, KeyAttestation: ka, Role: r.role}
	if !r.unsigned {
		signTPMRequest(t, key, req)
	}
	res, err := e.legs(t, req, r)
	return res, key, err
}

// legs sends req as bcd does: leg 1, then leg 2 with the activated answer.
func (e *tpmEnv) legs(t *testing.T, req *agentv1.JoinRequest, r tpmReq) (*agentv1.JoinResponse, error) {
	t.Helper()
	req.ChallengeResponse = nil
	peer := join.Peer{Addr: "192.0.2.9:1"}
	if r.peer != "" {
		peer.Addr = r.peer
	}
	res, err := e.svc.Join(context.Background(), relayed(req, r, 1), peer)
	if err != nil || len(res.GetChallenge()) == 0 {
		return res, err
	}
	var ch agentv1.TPMChallenge
	if err := proto.Unmarshal(res.GetChallenge(), &ch); err != nil {
		t.Fatal(err)
	}
	secret, err := e.tp.ActivateCredential(r.kind, ch.GetCredentialBlob(), ch.GetEncryptedSecret())
	if err != nil {
		t.Fatal(err)
	}
	if r.answer != nil {
		secret = r.answer(secret)
	}
	req.ChallengeResponse, _ = proto.Marshal(&agentv1.TPMChallengeAnswer{Secret: secret, ExpiresUnixMs: ch.GetExpiresUnixMs()})
	return e.svc.Join(context.Background(), relayed(req, r, 2), peer)
}

// relayed is what the relay forwards of leg: req itself, or a copy r.relay
// changed.
func relayed(req *agentv1.JoinRequest, r tpmReq, leg int) *agentv1.JoinRequest {
	if r.relay == nil {
		return req
	}
	c := proto.CloneOf(req)
	r.relay(leg, c)
	return c
}

// signTPMRequest signs req with its node key as bcd does (R15.1).
func signTPMRequest(t testing.TB, key crypto.Signer, req *agentv1.JoinRequest) {
	t.Helper()
	sig, err := pki.SignJoinRequest(key, pki.JoinRequestDigest(req))
	if err != nil {
		t.Fatal(err)
	}
	req.RequestSig = sig
}

func leafOf(t *testing.T, res *agentv1.JoinResponse) (*agentv1.JoinResponseBody, *x509.Certificate) {
	t.Helper()
	var body agentv1.JoinResponseBody
	if err := proto.Unmarshal(res.GetBody(), &body); err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(body.GetCertChain()[0])
	if err != nil {
		t.Fatal(err)
	}
	return &body, leaf
}

// trustCAs trusts the swtpm local CA for the root tenant's pool, and the
// P-256 EK (no certificate) by hash.
func (f *fixture) trustCAs(t testing.TB) func(*tpmtest.Sim, *tpmdevice.TPM) []tpm.Pool {
	return func(sim *tpmtest.Sim, tp *tpmdevice.TPM) []tpm.Pool {
		cas, err := tpmverify.LoadCAs(sim.CAFiles)
		if err != nil {
			t.Fatal(err)
		}
		p256, err := tp.EK(tpmdevice.EKP256)
		if err != nil {
			t.Fatal(err)
		}
		h, _ := tpmverify.EKHash(&p256.Public)
		return []tpm.Pool{{PoolID: f.pool.Id, Trust: tpmverify.Trust{CAs: cas, EKHashes: [][]byte{h}}}}
	}
}

// R9.2, R7.2: a token-less tpm join with each EK kind: nodeKey tpm, the
// certificate carries the AK statement after the SPIFFE ID, and renewal
// needs the AK's certify of the next key (R13.3).
func TestTPMJoinR9_2(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		env := newTPMEnv(t, f, f.trustCAs(t))
		ak, err := env.tp.AK()
		if err != nil {
			t.Fatal(err)
		}
		stmt, _ := tpmverify.Statement(ak.Name)
		for _, kind := range []tpmdevice.EKKind{tpmdevice.EKRSA2048, tpmdevice.EKP384, tpmdevice.EKP256} {
			res, key, err := env.join(t, tpmReq{kind: kind})
			if err != nil {
				t.Fatalf("%s: %v", kind, err)
			}
			body, leaf := leafOf(t, res)
			if len(leaf.URIs) != 2 || leaf.URIs[1].String() != stmt {
				t.Fatalf("%s: URIs %v, want the SPIFFE ID then %s", kind, leaf.URIs, stmt)
			}
			if n := f.node(t, body.GetNodeId()); n.NodeKey != tpm.NodeKeyTPM || n.Attestor != tpm.Name {
				t.Fatalf("%s: node key %q attestor %q", kind, n.NodeKey, n.Attestor)
			}
			if kind != tpmdevice.EKRSA2048 {
				continue
			}
			// R13.3: renewals of this leaf.
			chain := body.GetCertChain()
			renew := func(mod func(req *agentv1.RenewRequest, next *tpmdevice.Key)) (*agentv1.RenewResponse, error) {
				next, err := env.tp.NewNodeKey()
				if err != nil {
					t.Fatal(err)
				}
				csr, _ := identity.NewCSR(next, "")
				ms := env.clk.Now().UnixMilli()
				pop, err := pki.SignRenewPoP(key, csr, body.GetNodeId(), ms)
				if err != nil {
					t.Fatal(err)
				}
				att, err := env.tp.Certify(next, pki.CSRHash(csr))
				if err != nil {
					t.Fatal(err)
				}
				ka, _ := att.Marshal()
				req := &agentv1.RenewRequest{Csr: csr, Chain: chain, ClientTimeUnixMs: ms, PopSig: pop, NodeId: body.GetNodeId(), KeyAttestation: ka}
				if mod != nil {
					mod(req, next)
				}
				return env.svc.Renew(context.Background(), req, join.Peer{Addr: "192.0.2.9:1", Cert: chain[0]})
			}
			other := tpmtest.StartFresh(t).Open(t)
			for _, tc := range []struct {
				name, reason string
				mod          func(req *agentv1.RenewRequest, next *tpmdevice.Key)
			}{
				{"without key_attestation", join.ReasonKeyAttestationMissing, func(req *agentv1.RenewRequest, _ *tpmdevice.Key) { req.KeyAttestation = nil }},
				{"certified by another AK", join.ReasonKeyAttestationAK, func(req *agentv1.RenewRequest, _ *tpmdevice.Key) {
					k, err := other.NewNodeKey()
					if err != nil {
						t.Fatal(err)
					}
					csr, _ := identity.NewCSR(k, "")
					att, err := other.Certify(k, pki.CSRHash(csr))
					if err != nil {
						t.Fatal(err)
					}
					req.Csr = csr
					req.KeyAttestation, _ = att.Marshal()
					req.PopSig, _ = pki.SignRenewPoP(key, csr, req.NodeId, req.ClientTimeUnixMs)
				}},
			} {
				if _, err := renew(tc.mod); err == nil {
					t.Fatalf("renewal %s was not refused", tc.name)
				}
				if rs := renewReasons(t, f, e); !contains(rs, tc.reason) {
					t.Fatalf("renewal %s: reasons %v, want %s", tc.name, rs, tc.reason)
				}
			}
			rres, err := renew(nil)
			if err != nil {
				t.Fatalf("attested renewal: %v", err)
			}
			_, rleaf := leafOf(t, &agentv1.JoinResponse{Body: rres.GetBody()})
			if len(rleaf.URIs) != 2 || rleaf.URIs[1].String() != stmt {
				t.Fatalf("the renewed certificate lost the statement: %v", rleaf.URIs)
			}
		}
	})
}

// renewReasons reads the renewal refusal reasons of the root tenant.
func renewReasons(t *testing.T, f *fixture, e *apitest.Env) []string {
	t.Helper()
	var out []string
	for _, ev := range f.events(t, e.RootTenant, "security.renew.refused") {
		if r, ok := ev.Data["reason"].(string); ok {
			out = append(out, r)
		}
	}
	return out
}

// R9.2: each refusal with its own server-side reason; the machine learns
// only "Join refused".
func TestTPMJoinRefusedR9_2(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		env := newTPMEnv(t, f, f.trustCAs(t))
		notFixed := tpmdevice.NodeKeyTemplate
		notFixed.ObjectAttributes.FixedTPM, notFixed.ObjectAttributes.FixedParent = false, false
		other := tpmtest.StartFresh(t).Open(t)
		for _, tc := range []struct {
			name, reason string
			r            tpmReq
		}{
			{"node key not fixedTPM", tpmverify.ReasonNodeKeyNotFixedTPM, tpmReq{kind: tpmdevice.EKRSA2048, template: notFixed}},
			{"certify over another CSR", tpmverify.ReasonCertifyCSR, tpmReq{kind: tpmdevice.EKRSA2048, certifyOf: []byte("another csr")}},
			{"another AK", tpmverify.ReasonNodeKeyCSR, tpmReq{kind: tpmdevice.EKRSA2048, certifyBy: other}},
			{"wrong activation answer", tpm.ReasonActivation, tpmReq{kind: tpmdevice.EKRSA2048, answer: func(s []byte) []byte { s[0] ^= 1; return s }}},
		} {
			_, _, err := env.join(t, tc.r)
			jointest.WantRefused(t, err)
			if rs := jointest.Reasons(t, e.DB, e.RootTenant); !contains(rs, tpm.Name+":"+tc.reason) && !contains(rs, tc.reason) {
				t.Fatalf("%s: reasons %v, want %s", tc.name, rs, tc.reason)
			}
		}
	})
}

// R9.2, R10.1: an EK off the allow-list is refused when enrollment is off,
// and becomes an Approval (a join request keyed by its EK hash) when on.
func TestTPMUnknownEKR9_2(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		env := newTPMEnv(t, f, func(*tpmtest.Sim, *tpmdevice.TPM) []tpm.Pool {
			return []tpm.Pool{{PoolID: f.pool.Id}}
		})
		_, _, err := env.join(t, tpmReq{kind: tpmdevice.EKP256})
		jointest.WantRefused(t, err)
		if rs := jointest.Reasons(t, e.DB, e.RootTenant); !contains(rs, tpm.Name+":"+tpm.ReasonEKUnknown) {
			t.Fatalf("reasons %v, want %s", rs, tpm.ReasonEKUnknown)
		}
		// With enrollment: the attestor admits through an Approval keyed
		// by the EK hash (JoinService turns it into a join request).
		ta, err := tpm.New(tpm.Config{Pools: []tpm.Pool{{PoolID: f.pool.Id, Enrollment: true}}, ChallengeKey: bytes.Repeat([]byte{7}, 32), Clock: env.clk})
		if err != nil {
			t.Fatal(err)
		}
		key, _ := env.tp.NewNodeKey()
		csr, _ := identity.NewCSR(key, "")
		att, _ := env.tp.Certify(key, pki.CSRHash(csr))
		ka, _ := att.Marshal()
		ek, _ := env.tp.EK(tpmdevice.EKP256)
		ev, _ := proto.Marshal(&agentv1.TPMEvidence{EkPublic: ek.PublicBytes()})
		jr := &agentv1.JoinRequest{Csr: csr, Attestor: tpm.Name, Evidence: ev, KeyAttestation: ka}
		signTPMRequest(t, key, jr)
		in := &attest.Input{Role: "node", CSR: csr, CSRSHA256: pki.CSRHash(csr), Evidence: ev, KeyAttestation: ka,
			RequestDigest: pki.JoinRequestDigest(jr), RequestSig: jr.GetRequestSig()}
		// Leg 1 is the attestor's challenge; leg 2 carries the activation.
		c, err := ta.Challenge(context.Background(), in)
		if err != nil {
			t.Fatal(err)
		}
		var ch agentv1.TPMChallenge
		_ = proto.Unmarshal(c, &ch)
		secret, err := env.tp.ActivateCredential(tpmdevice.EKP256, ch.GetCredentialBlob(), ch.GetEncryptedSecret())
		if err != nil {
			t.Fatal(err)
		}
		in.Answer, _ = proto.Marshal(&agentv1.TPMChallengeAnswer{Secret: secret, ExpiresUnixMs: ch.GetExpiresUnixMs()})
		var adm *attest.Admission
		if err := e.DB.WithTx(context.Background(), func(tx *store.Tx) error {
			adm, err = ta.Admit(context.Background(), tx, in)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		h, _ := tpmverify.EKHash(&ek.Public)
		if adm.Approval == nil || !bytes.Equal(adm.Approval.EKHash, h) || adm.Approval.MachineKey != attest.MachineKeyFor(hwid.HardwareKey{}, h, f.site.Id, "") || adm.NodeKey != "tpm" {
			t.Fatalf("admission %+v", adm)
		}
	})
}

// R9.2, R10.1–R10.3: an unknown EK in a pool with enrollment waits on a
// join request keyed by its EK hash; nothing is issued until an operator
// approves it, then the same key and CSR join (both legs again, with a
// fresh challenge) with nodeKey tpm and the AK statement.
func TestTPMEnrollmentR10_1(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		env := newTPMEnv(t, f, func(*tpmtest.Sim, *tpmdevice.TPM) []tpm.Pool {
			return []tpm.Pool{{PoolID: f.pool.Id, Enrollment: true}}
		})
		key, err := env.tp.NewNodeKey()
		if err != nil {
			t.Fatal(err)
		}
		csr, _ := identity.NewCSR(key, "")
		att, _ := env.tp.Certify(key, pki.CSRHash(csr))
		ka, _ := att.Marshal()
		ek, _ := env.tp.EK(tpmdevice.EKP256)
		ev, _ := proto.Marshal(&agentv1.TPMEvidence{EkPublic: ek.PublicBytes()})
		req := &agentv1.JoinRequest{Csr: csr, Claims: jointest.Claims(9001), Attestor: tpm.Name, Protocol: 2, Evidence: ev, KeyAttestation: ka}
		signTPMRequest(t, key, req)
		m := &jointest.Machine{CSR: csr}
		res, err := env.legs(t, req, tpmReq{kind: tpmdevice.EKP256})
		if err != nil {
			t.Fatalf("leg 2: %v, want a deferral", err)
		}
		df := m.Deferral(t, e.Bundle, res)
		var jr store.JoinRequest
		f.read(t, func(tx *store.Tx) (err error) {
			jr, err = tx.GetJoinRequest(context.Background(), df.GetRequestId())
			return
		})
		h, _ := tpmverify.EKHash(&ek.Public)
		if jr.Attestor != tpm.Name || !bytes.Equal(jr.EKHash, h) || jr.State != store.JoinRequestPending {
			t.Fatalf("join request %+v: want a pending tpm request with the EK hash", jr)
		}
		if n := len(f.nodes(t, f.root)); n != 0 {
			t.Fatalf("%d nodes while the EK waits for approval, want 0", n)
		}
		err = e.DB.WithTx(context.Background(), func(tx *store.Tx) error {
			until := env.clk.Now().Add(15 * time.Minute)
			_, err := tx.DecideJoinRequest(context.Background(), jr.ID, store.JoinRequestApproved, "key_test", "new rack", "", env.clk.Now(), &until)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		env.clk.Advance(5 * time.Minute) // older than the first challenge: bcd asks anew
		res, err = env.legs(t, req, tpmReq{kind: tpmdevice.EKP256})
		if err != nil {
			t.Fatalf("the approved join: %v", err)
		}
		body, leaf := leafOf(t, res)
		if body.GetDeferral() != nil || len(leaf.URIs) != 2 || !tpmverify.IsStatement(leaf.URIs[1].String()) {
			t.Fatalf("approved answer %v: want a certificate with the tpm-ak statement", body)
		}
		if n := f.node(t, body.NodeId); n.NodeKey != "tpm" {
			t.Fatalf("node key %q, want tpm", n.NodeKey)
		}
	})
}

// R22.1, R22.2: two TPMs (real swtpm, each with its own EK and EK
// certificate from its own local CA) whose machines report the same
// claims wait on two requests with the same claims and hardware key; the
// API shows them apart by their evidence (EK hash, AK name, the EK
// certificate's issuer, untrusted) and names each as the other's double.
// Approving one admits that TPM only: the other still waits, and the node
// shows the admitted TPM's EK hash.
func TestTPMSameClaimsTwoRequestsR22_1(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		ctx := context.Background()
		f := newFixture(t, e)
		env := newTPMEnv(t, f, func(*tpmtest.Sim, *tpmdevice.TPM) []tpm.Pool {
			return []tpm.Pool{{PoolID: f.pool.Id, Enrollment: true}}
		})
		other := *env
		other.tp = tpmtest.StartFresh(t).Open(t)
		claims := jointest.Claims(9100)
		type machine struct {
			env *tpmEnv
			key *tpmdevice.Key
			req *agentv1.JoinRequest
			id  string
		}
		var ms []*machine
		for _, te := range []*tpmEnv{env, &other} {
			key, err := te.tp.NewNodeKey()
			if err != nil {
				t.Fatal(err)
			}
			csr, _ := identity.NewCSR(key, "")
			att, _ := te.tp.Certify(key, pki.CSRHash(csr))
			ka, _ := att.Marshal()
			ek, err := te.tp.EK(tpmdevice.EKRSA2048)
			if err != nil {
				t.Fatal(err)
			}
			ev, _ := proto.Marshal(&agentv1.TPMEvidence{EkPublic: ek.PublicBytes(), EkCertificate: ek.Cert})
			req := &agentv1.JoinRequest{Csr: csr, Claims: proto.CloneOf(claims), Attestor: tpm.Name, Protocol: 2, Evidence: ev, KeyAttestation: ka}
			signTPMRequest(t, key, req)
			res, err := te.legs(t, req, tpmReq{kind: tpmdevice.EKRSA2048})
			if err != nil {
				t.Fatalf("leg 2: %v, want a deferral", err)
			}
			df := (&jointest.Machine{CSR: csr}).Deferral(t, e.Bundle, res)
			ms = append(ms, &machine{env: te, key: key, req: req, id: df.GetRequestId()})
		}
		if ms[0].id == ms[1].id {
			t.Fatalf("two TPMs wait on one request %s", ms[0].id)
		}
		res, err := e.Admin.JoinRequests.ListJoinRequests(ctx, rq(&bcv1.ListJoinRequestsRequest{TenantId: f.root, PoolId: f.pool.Id}))
		if err != nil || len(res.Msg.Items) != 2 {
			t.Fatalf("list: %v %+v, want two requests", err, res)
		}
		a, b := res.Msg.Items[0], res.Msg.Items[1]
		if a.Id != ms[0].id {
			a, b = b, a
		}
		// What the machines say is the same ...
		if a.HardwareKey == "" || a.HardwareKey != b.HardwareKey || !proto.Equal(a.Claims, b.Claims) {
			t.Fatalf("claims %v / %v and hardware keys %q / %q: want the same", a.Claims, b.Claims, a.HardwareKey, b.HardwareKey)
		}
		// ... what the attestor established is not.
		for i, r := range []*bcv1.JoinRequest{a, b} {
			ev, eff := r.GetEvidence(), r.GetEffect()
			ek, _ := ms[i].env.tp.EK(tpmdevice.EKRSA2048)
			h, _ := tpmverify.EKHash(&ek.Public)
			if ev.GetEkSha256() != hex.EncodeToString(h) || ev.GetAkName() == "" || !ev.GetEkCertificatePresent() || ev.GetEkCertificateTrusted() ||
				ev.GetEkCertificateIssuer() == "" || ev.GetPeerAddress() != "192.0.2.9" {
				t.Errorf("request %s evidence %+v: want its TPM's EK %x, an AK, an untrusted EK certificate with its issuer, the peer", r.Id, ev, h)
			}
			if eff.GetKind() != "new-node" || len(eff.GetSameClaimsRequestIds()) != 1 || eff.GetSameClaimsRequestIds()[0] != ms[1-i].id {
				t.Errorf("request %s effect %+v: want a new node with the same claims as %s", r.Id, eff, ms[1-i].id)
			}
		}
		if a.Evidence.EkSha256 == b.Evidence.EkSha256 || a.Evidence.AkName == b.Evidence.AkName || a.Version == b.Version {
			t.Fatalf("evidence %+v and %+v: want two EKs and AKs", a.Evidence, b.Evidence)
		}
		// Approve the second TPM's request only.
		if _, err := e.Admin.JoinRequests.ApproveJoinRequest(ctx, rq(&bcv1.ApproveJoinRequestRequest{TenantId: f.root, PoolId: f.pool.Id,
			RequestId: b.Id, TtlSeconds: 900, Reason: "rack B7, EK checked", Version: b.Version})); err != nil {
			t.Fatalf("approve: %v", err)
		}
		env.clk.Advance(5 * time.Minute)
		first, err := env.legs(t, ms[0].req, tpmReq{kind: tpmdevice.EKRSA2048})
		if err != nil {
			t.Fatalf("the unapproved TPM: %v, want a deferral", err)
		}
		if df := (&jointest.Machine{CSR: ms[0].req.Csr}).Deferral(t, e.Bundle, first); df.GetRequestId() != ms[0].id {
			t.Fatalf("the unapproved TPM waits on %s, want %s", df.GetRequestId(), ms[0].id)
		}
		second, err := other.legs(t, ms[1].req, tpmReq{kind: tpmdevice.EKRSA2048})
		if err != nil {
			t.Fatalf("the approved TPM: %v", err)
		}
		if body, leaf := leafOf(t, second); body.GetDeferral() != nil || len(leaf.URIs) != 2 {
			t.Fatalf("the approved TPM's answer %v: want a certificate", body)
		}
		list, err := e.Admin.Nodes.ListNodes(ctx, rq(&bcv1.ListNodesRequest{TenantId: f.root}))
		if err != nil || len(list.Msg.Items) != 1 {
			t.Fatalf("nodes: %v %+v, want the approved TPM's one", err, list)
		}
		// The node shows the EK it was admitted with, in the list and the
		// node view, so an approver can cross-check a later request.
		got, err := e.Admin.Nodes.GetNode(ctx, rq(&bcv1.GetNodeRequest{TenantId: f.root, NodeId: list.Msg.Items[0].Id}))
		if err != nil || got.Msg.EkSha256 != b.Evidence.EkSha256 || list.Msg.Items[0].EkSha256 != b.Evidence.EkSha256 {
			t.Fatalf("node EK %q (listed %q), %v: want the approved request's %q", got.Msg.GetEkSha256(), list.Msg.Items[0].EkSha256, err, b.Evidence.EkSha256)
		}
	})
}

// R9.2, R6.4: a token join on a TPM host, its node key in the TPM and even
// with the AK's certify attached, says nodeKey unattested (node row,
// node.joined event and audit row) and carries no AK statement: only the tpm
// attestor proves a key. A pool whose policy.joinAttestors is ["tpm"]
// refuses that token join (pool-attestor) and admits the tpm join.
func TestTPMHostTokenJoinR6_4(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		env := newTPMEnv(t, f, f.trustCAs(t))
		tok := f.token(t, &bcv1.CreateJoinTokenRequest{MaxUses: 2})
		// tokenJoin is bcd's token join on this host, with the certify of
		// its TPM key attached.
		tokenJoin := func() (*agentv1.JoinResponse, error) {
			key, err := env.tp.NewNodeKey()
			if err != nil {
				t.Fatal(err)
			}
			csr, _ := identity.NewCSR(key, "")
			att, err := env.tp.Certify(key, pki.CSRHash(csr))
			if err != nil {
				t.Fatal(err)
			}
			tpmMachines++
			ka, _ := att.Marshal()
			req := &agentv1.JoinRequest{Csr: csr, Claims: jointest.Claims(tpmMachines), Protocol: 1, KeyAttestation: ka}
			req.SealedToken = jointest.SealAt(t, e.Bundle, tok.Token, req, time.Now())
			return env.svc.Join(context.Background(), req, join.Peer{Addr: "192.0.2.9:1"})
		}

		if _, err := e.Admin.Pools.UpdatePoolPolicy(context.Background(), rq(&bcv1.UpdatePoolPolicyRequest{TenantId: f.root, PoolId: f.pool.Id,
			Policy: &bcv1.PoolPolicy{JoinAttestors: []string{tpm.Name}}})); err != nil {
			t.Fatal(err)
		}
		f.refusedOnce(t, f.root, reason("pool-attestor"), func() error { _, err := tokenJoin(); return err })
		if got := f.usesLeft(t, tok.Id); got != 2 {
			t.Errorf("usesLeft %d after the refusal, want 2", got)
		}
		res, _, err := env.join(t, tpmReq{kind: tpmdevice.EKRSA2048})
		if err != nil {
			t.Fatalf("tpm join into a tpm-only pool: %v", err)
		}
		if body, _ := leafOf(t, res); f.node(t, body.GetNodeId()).NodeKey != tpm.NodeKeyTPM {
			t.Fatalf("the tpm join says node key %q", f.node(t, body.GetNodeId()).NodeKey)
		}

		if _, err := e.Admin.Pools.UpdatePoolPolicy(context.Background(), rq(&bcv1.UpdatePoolPolicyRequest{TenantId: f.root, PoolId: f.pool.Id,
			Policy: &bcv1.PoolPolicy{JoinAttestors: []string{tpm.Name, jointoken.Name}}})); err != nil {
			t.Fatal(err)
		}
		res, err = tokenJoin()
		if err != nil {
			t.Fatalf("token join on a TPM host: %v", err)
		}
		body, leaf := leafOf(t, res)
		if len(leaf.URIs) != 1 {
			t.Fatalf("URIs %v: a token join carries no AK statement", leaf.URIs)
		}
		if n := f.node(t, body.GetNodeId()); n.NodeKey != "unattested" || n.Attestor != jointoken.Name {
			t.Fatalf("node key %q attestor %q, want unattested by join-token", n.NodeKey, n.Attestor)
		}
		var evKey, auditKey any
		for _, ev := range f.events(t, f.root, "node.joined") {
			if ev.Subject == body.GetNodeId() {
				evKey = ev.Data["nodeKey"]
			}
		}
		for _, r := range f.audit(t, f.root, "node.joined") {
			if r.Data["nodeId"] == body.GetNodeId() {
				auditKey = r.Data["nodeKey"]
			}
		}
		if evKey != "unattested" || auditKey != "unattested" {
			t.Fatalf("node.joined event nodeKey %v, audit row %v; want unattested", evKey, auditKey)
		}
	})
}
