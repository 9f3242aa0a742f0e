package enroll

import (
	"context"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/tpmdevice"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/version"
)

// TPMAttester is the KeyStore a tpm join needs: node keys in the TPM that
// its AK certifies, the EK as evidence, and credential activation.
type TPMAttester interface {
	identity.KeyAttester
	// Evidence returns the tpm attestor's evidence and its EK's kind.
	Evidence() ([]byte, tpmdevice.EKKind, error)
	// Answer activates the control plane's challenge with that EK.
	Answer(kind tpmdevice.EKKind, challenge []byte) ([]byte, error)
}

// tpmJoin is `bcd join --attestor tpm` (R9.2): no token. The node key is
// made in the TPM; the request carries the EK (and its certificate) and
// the AK's certify of the key over sha256(csr). The control plane answers a
// credential challenge, which only this TPM can activate, and bcd sends the
// same request again with the activated secret.
func (j *Joiner) tpmJoin(ctx context.Context, opts Options, role string) (*identity.Identity, error) {
	keys, ok := j.keys.(TPMAttester)
	if !ok {
		return nil, errs.New(errs.InvalidConfig, "--attestor tpm needs this machine's TPM, and none is open: check [tpm] in config.toml (mode, device or simulator) and bcd doctor")
	}
	if j.cfg.BCD == nil || opts.Bootstrap != nil {
		return nil, errs.New(errs.InvalidConfig, "bcd join --attestor tpm needs %s (from the install script); it takes no --site or pin flags", j.cfg.ConfigPath)
	}
	cfg := *j.cfg.BCD
	cfg.ApplyDefaults()
	syncPins(&cfg, j.pins)
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	var old *oldIdentity
	var err error
	if opts.Reset {
		if old, err = j.oldIdentity(); err != nil {
			return nil, err
		}
	} else if err := j.refuseJoined(); err != nil {
		return nil, err
	}

	cl, signer, keyRecord, csr, err := j.claimsAndKey(&cfg)
	if err != nil {
		return nil, err
	}
	j.progress("certifying the node key with the TPM's attestation key…")
	att, _, err := keys.AttestKey(signer, csr)
	if err != nil {
		return nil, errs.Wrap(err, errs.Unavailable, "the TPM cannot certify the node key: %v", err)
	}
	ev, kind, err := keys.Evidence()
	if err != nil {
		return nil, errs.Wrap(err, errs.Unavailable, "%v", err)
	}
	req := &agentv1.JoinRequest{
		Csr: csr, Claims: wireClaims(cl), Attestor: identity.AttestorTPM, Role: role, NodeId: opts.NodeID,
		Protocol: version.ProtocolMax, Evidence: ev, KeyAttestation: att,
	}
	// R15.1: the node key, in the TPM, signs the whole request; both legs
	// carry the same signature (the answer is outside the digest).
	if req.RequestSig, err = pki.SignJoinRequest(signer, pki.JoinRequestDigest(req)); err != nil {
		return nil, errs.Wrap(err, errs.Unavailable, "the TPM cannot sign the join request with the node key: %v", err)
	}
	// Both legs make one attempt: a retry after a deferral (an unknown EK
	// enrolling through a join request, R10.1) starts again at leg 1, so
	// its challenge is always fresh. The key and CSR stay the same: the
	// ones an approval admits.
	attempt := func() (*agentv1.JoinResponse, bool, error) {
		req.ChallengeResponse = nil
		res, answered, err := j.send(ctx, &cfg, req, nil)
		if err != nil || len(res.GetChallenge()) == 0 {
			return res, answered, err
		}
		if !j.waiting {
			j.progress("activating the control plane's credential challenge in the TPM…")
		}
		answer, aerr := keys.Answer(kind, res.GetChallenge())
		if aerr != nil {
			return nil, true, errs.Wrap(aerr, errs.Unavailable, "the TPM cannot activate the control plane's challenge: %v", aerr)
		}
		req.ChallengeResponse = answer
		return j.send(ctx, &cfg, req, nil)
	}
	body, err := j.untilDecided(ctx, expectation{
		liveRetired:   func() []string { return cfg.RetiredPins },
		livePins:      cfg.JoinSigningPins,
		csrHash:       pki.CSRHash(csr),
		nodeKey:       signer.Public(),
		siteID:        cfg.Site,
		nodeID:        opts.NodeID,
		role:          role,
		allowDeferral: true,
	}, "bcd join --attestor tpm again", attempt)
	if err != nil {
		if old != nil && errs.CodeOf(err) == errs.AccessDenied {
			return nil, old.refused(err, reclaimByTPM)
		}
		return nil, err
	}
	id, aside, err := j.install(body, keyRecord, identity.AttestorTPM, opts.Reset)
	if err != nil {
		return nil, err
	}
	j.learnAnswer("join answer", body)
	if aside != "" {
		j.progress("moved the old identity aside to %s", aside)
	}
	return id, nil
}
