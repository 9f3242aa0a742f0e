package join

import (
	"context"
	"errors"
	"fmt"
	"time"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/bcd/identity"
	"github.com/better-compute/better-compute/internal/errs"
	"github.com/better-compute/better-compute/internal/pki"
	"github.com/better-compute/better-compute/internal/version"
)

// X509PopMaxExpired is how long after its expiry the control plane still
// lets a certificate re-join its node (R10.5); bcd only uses it in messages,
// the control plane decides.
const X509PopMaxExpired = 7 * 24 * time.Hour

// rejoin is `bcd join --attestor x509pop` (R10.5): the machine's
// certificate expired while it was offline, so it cannot renew; it proves
// possession of the expired certificate's key instead and comes back as the
// same node. No token is involved. The expired identity is moved aside only
// after the answer verified, and put back when the new one cannot be saved.
func (j *Joiner) rejoin(ctx context.Context, opts Options) (*identity.Identity, error) {
	if j.cfg.BCD == nil || opts.Bootstrap != nil {
		return nil, errs.New(errs.InvalidConfig,
			"bcd join --attestor x509pop re-joins with the configuration the node joined with: it needs %s and takes no --site or pin flags", j.cfg.ConfigPath)
	}
	cfg := *j.cfg.BCD
	cfg.ApplyDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}

	old, err := j.cfg.Store.Load()
	switch {
	case errors.Is(err, identity.ErrNotJoined):
		return nil, errs.New(errs.InvalidState,
			"no identity in %s: --attestor x509pop re-joins a node whose certificate expired, with that certificate; a machine that never joined joins with a join token", j.cfg.Store.Dir)
	case err != nil:
		return nil, err
	}
	now := j.clock.Now()
	if !old.Expired(now) {
		return nil, errs.New(errs.InvalidState,
			"the certificate is still valid: bcd renews it; run bcd renew (it expires at %s)", old.NotAfter.Format(time.RFC3339))
	}
	if old.SiteID != cfg.Site {
		return nil, errs.New(errs.InvalidState, "the identity in %s is of site %s, but config.toml names site %s; nothing was sent", j.cfg.Store.Dir, old.SiteID, cfg.Site)
	}
	if opts.NodeID != "" && opts.NodeID != old.NodeID {
		return nil, errs.Invalid("--node-id", "this machine is node %s; x509pop re-joins only that node", old.NodeID)
	}
	// The node keeps its role; a node-tenant certificate asks for node, its
	// family.
	role := old.Role
	ask := role
	if ask == pki.RoleNodeTenant {
		ask = pki.RoleNode
	}
	if opts.Role != "" && opts.Role != role && opts.Role != ask {
		return nil, errs.Invalid("--role", "this node's role is %s; x509pop re-joins it with that role", role)
	}

	cl, signer, keyRecord, csr, err := j.claimsAndKey(&cfg)
	if err != nil {
		return nil, err
	}

	// The evidence, signed with the expired certificate's key.
	chain := make([][]byte, len(old.Chain))
	for i, c := range old.Chain {
		chain[i] = c.Raw
	}
	req := &agentv1.JoinRequest{
		Csr:      csr,
		Claims:   wireClaims(cl),
		Attestor: identity.AttestorX509Pop,
		Role:     ask,
		NodeId:   old.NodeID,
		Protocol: version.ProtocolMax,
		X509Pop:  &agentv1.X509Pop{Chain: chain, ClientTimeUnixMs: j.clock.Now().UnixMilli()},
	}
	// R4.2: the evidence signs the digest of the complete request.
	sig, err := pki.SignX509Pop(old.Signer, pki.JoinRequestDigest(req))
	if err != nil {
		return nil, fmt.Errorf("sign the x509pop evidence with the expired certificate's key: %w", err)
	}
	req.X509Pop.Sig = sig
	res, err := j.call(ctx, &cfg, req)
	if err != nil {
		if e, ok := errs.As(err); ok && e.Code == errs.AccessDenied {
			return nil, errs.New(errs.AccessDenied,
				"%s; x509pop re-joins a node only within %s of its certificate's expiry (it expired at %s), when the control plane runs the x509pop attestor and the pool's policy allows it; otherwise join again with a new token: bcd join --reset --yes, then bcd join",
				e.Message, X509PopMaxExpired, old.NotAfter.Format(time.RFC3339))
		}
		return nil, err
	}
	body, err := verifyResponse(res, expectation{
		signingPin:  cfg.JoinSigningKeyPin,
		csrHash:     pki.CSRHash(csr),
		nodeKey:     signer.Public(),
		siteID:      cfg.Site,
		nodeID:      old.NodeID,
		role:        role,
		trustDomain: old.TrustDomain,
		rejoin:      true,
	})
	if err != nil {
		return nil, err
	}

	// Only now is the expired identity moved aside, as --reset does; if the
	// new one cannot be saved, it is put back.
	aside, err := j.cfg.Store.MoveAside(j.clock.Now())
	if err != nil {
		return nil, fmt.Errorf("move the expired identity aside: %w; the new certificate was not saved", err)
	}
	id, err := j.save(body, keyRecord, identity.AttestorX509Pop)
	if err != nil {
		if rerr := j.restore(aside); rerr != nil {
			return nil, fmt.Errorf("%w; putting the expired identity back failed (%v): it is in %s", err, rerr, aside)
		}
		return nil, fmt.Errorf("%w; the expired identity was put back", err)
	}
	j.progress("re-joined as %s; the expired identity is in %s", id.NodeID, aside)
	return id, nil
}

// restore removes whatever a failed save left and moves the identity in
// dir back.
func (j *Joiner) restore(dir string) error {
	if present, err := j.cfg.Store.Present(); err == nil && len(present) > 0 {
		// Save rolls its own files back; anything still here is partial.
		if _, err := j.cfg.Store.MoveAside(j.clock.Now()); err != nil {
			return err
		}
	}
	return j.cfg.Store.Restore(dir)
}
