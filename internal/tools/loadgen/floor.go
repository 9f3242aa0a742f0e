package loadgen

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// Floor is the CPU the API cannot avoid per join and per renewal: the
// product's own crypto, measured in this process right after a run, on the
// same machine under the same load, so the ratio of the API's CPU per join
// to it holds on a noisy machine.
//
// A join: check the CSR (pki.ParseCSR: one ECDSA verification), open the
// seal (ca.Open: ECDH-ES, key unwrap, AES-GCM), sign the node certificate
// (ca.SignNodeCertKey: one signature, one verification, parse) and sign
// the answer (pki.SignResponse). A renewal: the CSR, the renew-pop proof
// (pki.VerifyRenewPoP), the certificate and the answer.
type Floor struct {
	JoinMs  float64 `json:"joinMs"`
	RenewMs float64 `json:"renewMs"`
}

// floorIterations bounds one measurement: enough CPU to make /proc's
// 10 ms ticks a small error.
const floorIterations = 2000

// MeasureFloor measures the Floor; it takes about a second of CPU.
func MeasureFloor() (Floor, error) {
	now := time.Now()
	b, err := ca.Generate("floor.example.com", now.Add(-time.Hour))
	if err != nil {
		return Floor{}, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return Floor{}, err
	}
	csr, err := identity.NewCSR(key, "loadgen")
	if err != nil {
		return Floor{}, err
	}
	digest := sha256.Sum256([]byte("request"))
	seal, err := pki.Seal(&b.JoinEncryptionKey.PublicKey, "bc_jt_floor", csr, digest[:], now)
	if err != nil {
		return Floor{}, err
	}
	clientMS := now.UnixMilli()
	pop, err := pki.SignRenewPoP(key, csr, "node_floor", clientMS)
	if err != nil {
		return Floor{}, err
	}
	params := ca.NodeCertParams{TrustDomain: "floor.example.com", SiteID: "site_floor", NodeID: "node_floor", Role: pki.RoleNode,
		NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)}
	answer := make([]byte, 600) // about a join answer's body
	// common is what a join and a renewal share: the CSR, the certificate,
	// the signed answer.
	common := func() error {
		pub, err := pki.ParseCSR(csr)
		if err != nil {
			return err
		}
		if _, err := ca.SignNodeCertKey(b.NodeCA, b.NodeCAKey, pub, params); err != nil {
			return err
		}
		_, err = pki.SignResponse(b.JoinSigningKey, answer)
		return err
	}
	// The API holds one opener for its key (join.Service), so does the floor.
	seals, err := ca.NewSealOpener(b.JoinEncryptionKey)
	if err != nil {
		return Floor{}, err
	}
	var f Floor
	if f.JoinMs, err = cpuPerOp(func() error {
		if _, err := seals.Open(seal, csr, digest[:], now); err != nil {
			return err
		}
		return common()
	}); err != nil {
		return Floor{}, fmt.Errorf("join floor: %w", err)
	}
	if f.RenewMs, err = cpuPerOp(func() error {
		if err := pki.VerifyRenewPoP(&key.PublicKey, csr, "node_floor", clientMS, pop); err != nil {
			return err
		}
		return common()
	}); err != nil {
		return Floor{}, fmt.Errorf("renewal floor: %w", err)
	}
	return f, nil
}

// cpuPerOp runs op floorIterations times and returns this process's CPU
// milliseconds per run, read from /proc as for the servers.
func cpuPerOp(op func() error) (float64, error) {
	self := map[string][]int{"self": {os.Getpid()}}
	before := cpuTimes(self)
	for range floorIterations {
		if err := op(); err != nil {
			return 0, err
		}
	}
	return cpuPer(before, cpuTimes(self), floorIterations)["self"], nil
}

// Summary is one line for the run: the rate, the p99, each process's CPU per
// operation and the API's as a multiple of the crypto floor (of the renewal
// phase in renew mode).
func (r *Result) Summary() string {
	op, rate, p99, cpu, conns := "join", r.JoinsPerSecond, r.P99ms, r.CPUmsPerJoin, "reused connections"
	if r.NewConnections {
		conns = "a new TLS connection each"
	}
	var floor float64
	if r.Floor != nil {
		floor = r.Floor.JoinMs
	}
	if rr := r.Renew; rr != nil {
		op, rate, p99, cpu, conns = "renewal", rr.RenewalsPerSecond, rr.P99ms, rr.CPUmsPerRenewal, "own connection"
		if rr.NewConnections {
			conns = "a new TLS connection each"
		}
		if r.Floor != nil {
			floor = r.Floor.RenewMs
		}
	}
	s := fmt.Sprintf("summary: %s, %s: %.0f/s, p99 %.1f ms", op, conns, rate, p99)
	names := make([]string, 0, len(cpu))
	for name := range cpu {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		s += fmt.Sprintf(", %s %.3f ms", name, cpu[name])
		if name == "api" && floor > 0 {
			s += fmt.Sprintf(" (%.1fx the floor)", cpu[name]/floor)
		}
	}
	if floor > 0 {
		s += fmt.Sprintf(", crypto floor %.3f ms per %s", floor, op)
	}
	return s
}
