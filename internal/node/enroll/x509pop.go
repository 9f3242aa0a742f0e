package enroll

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/version"
)

// X509PopMaxExpired is how long after its expiry the control plane still
// lets a certificate re-join its node (R10.5); bcd only uses it in messages,
// the control plane decides.
const X509PopMaxExpired = 7 * 24 * time.Hour

// rejoin is `bcd join --attestor x509pop` (R10.5): the machine's
// certificate expired while it was offline, so it cannot renew; it proves
// possession of the expired certificate's key instead and comes back as the
// same node. No token is involved. The expired identity is replaced, and
// kept aside, only after the answer verified; it stays in place when the new
// one cannot be saved. Like a token join, the request is retried while the
// failure is transient and kept in join.pending until its answer is saved
// (R4.9).
func (j *Joiner) rejoin(ctx context.Context, opts Options) (*identity.Identity, error) {
	if j.cfg.BCD == nil || opts.Bootstrap != nil {
		return nil, errs.New(errs.InvalidConfig,
			"bcd join --attestor x509pop re-joins with the configuration the node joined with: it needs %s and takes no --site or pin flags", j.cfg.ConfigPath)
	}
	cfg := *j.cfg.BCD
	cfg.ApplyDefaults()
	syncPins(&cfg, j.pins)
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

	// R4.9: the request of an earlier run that got no answer, when it was
	// made with this expired certificate, or a new one recorded before it
	// is first sent.
	want := pendingKey{attestor: identity.AttestorX509Pop, role: ask, nodeID: old.NodeID, site: cfg.Site}
	sameLeaf := func(r *agentv1.JoinRequest) bool {
		chain := r.GetX509Pop().GetChain()
		return len(chain) > 0 && bytes.Equal(chain[0], old.Leaf().Raw)
	}
	p := j.takePending(want, old, sameLeaf)
	for {
		if p != nil {
			j.progress("sending the request of an earlier re-join that got no answer (%s) again…", j.pendingPath())
		} else if p, err = j.newRejoinRequest(&cfg, old, ask); err != nil {
			return nil, err
		}
		res, answered, err := j.send(ctx, &cfg, p.req, nil)
		if err != nil {
			err = j.sendFailed(err, answered, "bcd join --attestor x509pop again")
			if e, ok := errs.As(err); ok && e.Code == errs.AccessDenied {
				if p.fromFile {
					// Had the earlier request landed, its stored answer
					// would have come back; its proof is dated, so make a
					// fresh one, once.
					j.progress("the control plane refused the earlier request; making a new one…")
					p = nil
					continue
				}
				return nil, errs.New(errs.AccessDenied,
					"%s; x509pop re-joins a node only within %s of its certificate's expiry (it expired at %s), when the control plane runs the x509pop attestor and the pool's policy allows it; otherwise join again with a new token: bcd join --reset --yes, then bcd join",
					e.Message, X509PopMaxExpired, old.NotAfter.Format(time.RFC3339))
			}
			return nil, err
		}
		body, err := verifyResponse(res, expectation{
			liveRetired: func() []string { return cfg.RetiredPins },
			livePins:    cfg.JoinSigningPins,
			csrHash:     pki.CSRHash(p.req.GetCsr()),
			nodeKey:     p.signer.Public(),
			siteID:      cfg.Site,
			nodeID:      old.NodeID,
			role:        role,
			trustDomain: old.TrustDomain,
			rejoin:      true,
		})
		if err != nil {
			return nil, err
		}
		// Only now is the expired identity replaced, in one step, and kept
		// aside as --reset does; if the new one cannot be saved, the
		// expired one stays in place.
		id, aside, err := j.install(body, p.keyRecord, identity.AttestorX509Pop, true)
		if err != nil {
			return nil, fmt.Errorf("%w; the expired identity is still in place", err)
		}
		j.learnAnswer("re-join answer", body)
		j.progress("re-joined as %s; the expired identity is in %s", id.NodeID, aside)
		return id, nil
	}
}

// newRejoinRequest makes the new key and the complete x509pop request, signs
// its digest with the expired certificate's key (R4.2), and records it in
// join.pending before it is first sent (R4.9).
func (j *Joiner) newRejoinRequest(cfg *bcdconfig.Config, old *identity.Identity, role string) (*pending, error) {
	cl, signer, keyRecord, csr, err := j.claimsAndKey(cfg)
	if err != nil {
		return nil, err
	}
	chain := make([][]byte, len(old.Chain))
	for i, c := range old.Chain {
		chain[i] = c.Raw
	}
	req := &agentv1.JoinRequest{
		Csr:      csr,
		Claims:   wireClaims(cl),
		Attestor: identity.AttestorX509Pop,
		Role:     role,
		NodeId:   old.NodeID,
		Protocol: version.ProtocolMax,
		X509Pop:  &agentv1.X509Pop{Chain: chain, ClientTimeUnixMs: j.serverTime.StampNow().UnixMilli()},
	}
	sig, err := pki.SignX509Pop(old.Signer, pki.JoinRequestDigest(req))
	if err != nil {
		return nil, fmt.Errorf("sign the x509pop evidence with the expired certificate's key: %w", err)
	}
	req.X509Pop.Sig = sig
	p := &pending{req: req, signer: signer, keyRecord: keyRecord}
	if err := j.writePending(p, "", cfg.Site); err != nil {
		return nil, err
	}
	return p, nil
}
