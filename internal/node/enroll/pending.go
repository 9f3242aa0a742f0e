package enroll

import (
	"crypto"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/fsutil"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// PendingFile is the join request bcd sent and has no saved answer for yet,
// in the data directory (R4.9). JoinService keeps the answer to a request by
// the request's digest, so when the answer to a join that landed is lost
// (the gateway or the network failed after the commit, bcd was killed),
// sending the very same request again gets that answer back and spends
// nothing. This file is what makes "the very same request" possible across
// runs of bcd join: it holds the new node key's record, the request (CSR,
// claims, attestor, role, node id, x509pop evidence) without its seal, and
// the SHA-256 of the join token, never the token.
//
// A later bcd join with the same token (same hash), attestor, role, node id
// and site sends that request again with a fresh seal; any other join
// discards the file, so a request is never sent for another token. The file
// is removed once the answer is saved, or when the control plane gave a
// definite answer other than the certificate (a refusal: the request did
// not land).
//
// SECURITY: it holds a private key record, like node.key: written 0600 and
// atomically, and refused when group or others can read it.
const PendingFile = "join.pending"

const (
	pendingVersion = 1
	maxPendingSize = 256 << 10
)

// pendingJSON is join.pending on disk.
type pendingJSON struct {
	Version int `json:"version"`
	// TokenSHA256 is the hex SHA-256 of the join token; empty for a join
	// without one (x509pop).
	TokenSHA256 string `json:"token_sha256,omitempty"`
	// Site is config.toml's site when the request was made.
	Site string `json:"site"`
	// KeyRecord is the new node key's node.key record (PEM).
	KeyRecord string `json:"key_record"`
	// Request is the JoinRequest without its seal (protobuf JSON).
	Request json.RawMessage `json:"request"`
	// RequestDigest is pki.JoinRequestDigest of Request, hex: what
	// JoinService keys the answer by, and a check that the file is whole.
	RequestDigest string    `json:"request_digest"`
	CreatedAt     time.Time `json:"created_at"`
}

// pending is a request to send, with its key.
type pending struct {
	req       *agentv1.JoinRequest
	signer    crypto.Signer
	keyRecord []byte
	// fromFile is set when it was read from join.pending, i.e. an earlier
	// run sent it.
	fromFile bool
}

// pendingKey is what a pending request must match to be sent again.
type pendingKey struct {
	tokenSHA256 string // "" without a token
	attestor    string // the wire's: "" or x509pop
	role        string
	nodeID      string
	site        string
}

// TokenHash is the hex SHA-256 of a join token as join.pending records it.
func TokenHash(token string) string {
	if token == "" {
		return ""
	}
	sum := sha256.Sum256([]byte(token))
	return hex.EncodeToString(sum[:])
}

func (j *Joiner) pendingPath() string { return filepath.Join(j.cfg.Store.Dir, PendingFile) }

// keysFor returns the KeyStore that reopens a key record: a TPM record with
// the Joiner's keys (they made it), a software record with SoftwareKeys.
func (j *Joiner) keysFor(record []byte) identity.KeyStore {
	if identity.RecordKind(record) == identity.KindTPM {
		return j.keys
	}
	return identity.SoftwareKeys{}
}

// takePending returns the pending request when it is the one this join
// would send (same token hash, attestor, role, node id and site) and its
// key was not saved as the identity current already holds; nil otherwise.
// Anything else in join.pending, damaged files included, is removed with a
// warning: it is never sent for another token. check, when set, refuses a
// request for another reason (x509pop: another expired certificate).
func (j *Joiner) takePending(want pendingKey, current *identity.Identity, check func(*agentv1.JoinRequest) bool) *pending {
	p, err := j.readPending(want)
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			j.log.Warn("discarding the pending join request", telemetry.LogFile, j.pendingPath(), telemetry.LogReason, err.Error())
			j.progress("discarding %s: %s", j.pendingPath(), err)
			j.removePending()
		}
		return nil
	}
	if check != nil && !check(p.req) {
		j.progress("discarding %s: it was made for another identity", j.pendingPath())
		j.removePending()
		return nil
	}
	if current != nil && current.Signer != nil && publicKeyEqual(current.Signer.Public(), p.signer.Public()) {
		// Its answer was saved; only the removal did not happen.
		j.removePending()
		return nil
	}
	return p
}

// readPending reads and checks join.pending against want. An error matching
// fs.ErrNotExist means there is none; any other error says why it cannot
// be used.
func (j *Joiner) readPending(want pendingKey) (*pending, error) {
	path := j.pendingPath()
	st, err := os.Lstat(path)
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("not a regular file")
	}
	// SECURITY: the file holds a private key record.
	if perm := st.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("readable by group or others (mode %04o): its key may have been read", perm)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("read: %w", err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxPendingSize+1))
	if err != nil {
		return nil, fmt.Errorf("read: %w", err)
	}
	if len(data) > maxPendingSize {
		return nil, fmt.Errorf("larger than %d bytes", maxPendingSize)
	}
	var pj pendingJSON
	if err := json.Unmarshal(data, &pj); err != nil {
		return nil, fmt.Errorf("not valid JSON")
	}
	if pj.Version != pendingVersion {
		return nil, fmt.Errorf("version %d, want %d", pj.Version, pendingVersion)
	}
	req := &agentv1.JoinRequest{}
	if err := protojson.Unmarshal(pj.Request, req); err != nil {
		return nil, fmt.Errorf("the request does not parse")
	}
	if hex.EncodeToString(pki.JoinRequestDigest(req)) != pj.RequestDigest {
		return nil, fmt.Errorf("the request does not match its digest")
	}
	// The match: never another token's, attestor's, role's, node's or
	// site's request.
	switch {
	case subtle.ConstantTimeCompare([]byte(pj.TokenSHA256), []byte(want.tokenSHA256)) != 1:
		return nil, fmt.Errorf("it was made for another join token")
	case req.GetAttestor() != want.attestor || req.GetRole() != want.role || req.GetNodeId() != want.nodeID:
		return nil, fmt.Errorf("it was made for another attestor, role or node id")
	case pj.Site != want.site:
		return nil, fmt.Errorf("it was made for site %s", pj.Site)
	case req.GetSealedToken() != "":
		return nil, fmt.Errorf("it holds a sealed token")
	}
	record := []byte(pj.KeyRecord)
	signer, err := j.keysFor(record).LoadKey(record)
	if err != nil {
		return nil, fmt.Errorf("its key does not open: %v", errs.MessageOf(err))
	}
	csrKey, err := pki.ParseCSR(req.GetCsr())
	if err != nil || !csrKey.Equal(signer.Public()) {
		return nil, fmt.Errorf("its key is not the key of its certificate request")
	}
	return &pending{req: req, signer: signer, keyRecord: record, fromFile: true}, nil
}

// writePending records p (sealless) before its first send.
func (j *Joiner) writePending(p *pending, tokenSHA256, site string) error {
	req, err := protojson.Marshal(p.req)
	if err != nil {
		return fmt.Errorf("marshal the pending join request: %w", err)
	}
	data, err := json.MarshalIndent(pendingJSON{
		Version: pendingVersion, TokenSHA256: tokenSHA256, Site: site, KeyRecord: string(p.keyRecord),
		Request: req, RequestDigest: hex.EncodeToString(pki.JoinRequestDigest(p.req)), CreatedAt: j.clock.Now().UTC(),
	}, "", "  ")
	if err != nil {
		return fmt.Errorf("marshal the pending join request: %w", err)
	}
	if err := os.MkdirAll(j.cfg.Store.Dir, 0o700); err != nil {
		return fmt.Errorf("create the data directory: %w", err)
	}
	if err := fsutil.WriteFileAtomic(j.pendingPath(), append(data, '\n'), 0o600); err != nil {
		return fmt.Errorf("record the join request before sending it: %w", err)
	}
	return nil
}

// removePending removes join.pending; a failure is only logged: the next
// join recognises a pending request whose key is already the identity's.
func (j *Joiner) removePending() {
	if err := os.Remove(j.pendingPath()); err != nil && !errors.Is(err, fs.ErrNotExist) {
		j.log.Warn("could not remove the pending join request", telemetry.LogFile, j.pendingPath(), telemetry.LogErr, err)
		return
	}
	fsutil.SyncDir(j.cfg.Store.Dir)
}

func publicKeyEqual(a, b crypto.PublicKey) bool {
	k, ok := a.(interface{ Equal(crypto.PublicKey) bool })
	return ok && k.Equal(b)
}
