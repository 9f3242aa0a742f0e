// Package jointoken is the join-token attestor: it locks the token row,
// checks the secret in constant time, revocation, expiry at compute_now(),
// the uses left and the role, and spends one use, all inside the admission
// transaction (so a refusal later in the join gives the use back).
package jointoken

import (
	"context"
	"errors"

	"github.com/better-compute/better-compute/internal/join/attest"
	tokens "github.com/better-compute/better-compute/internal/jointoken"
	"github.com/better-compute/better-compute/internal/secret"
	"github.com/better-compute/better-compute/internal/store"
)

// Name of the attestor.
const Name = "join-token"

// Attestor admits machines that present a join token.
type Attestor struct{}

// New returns the attestor.
func New() *Attestor { return &Attestor{} }

// Name implements attest.Attestor.
func (*Attestor) Name() string { return Name }

// Admit implements attest.Attestor.
func (*Attestor) Admit(ctx context.Context, tx *store.Tx, in *attest.Input) (*attest.Admission, error) {
	if in.Token == "" {
		return nil, attest.Refuse("token-missing", "")
	}
	id, plain, ok := tokens.Parse(in.Token)
	if !ok {
		return nil, attest.Refuse("token-malformed", "")
	}
	tok, err := tx.LockJoinToken(ctx, id)
	if errors.Is(err, store.ErrNotFound) {
		// Same work as a wrong secret, so timing says little about ids.
		secret.Matches(plain, make([]byte, 32))
		return nil, attest.Refuse("token-unknown", "")
	}
	if err != nil {
		return nil, err
	}
	if !secret.Matches(plain, tok.SecretSHA256) {
		return nil, attest.Refuse("token-secret", "")
	}
	// The secret verified: from here on refusals go to the token's tenant.
	switch tokens.State(tok) {
	case tokens.StateRevoked:
		return nil, attest.Refuse("token-revoked", tok.TenantID)
	case tokens.StateUsedUp:
		return nil, attest.Refuse("token-used-up", tok.TenantID)
	case tokens.StateExpired:
		return nil, attest.Refuse("token-expired", tok.TenantID)
	}
	if tok.Role != in.Role {
		return nil, attest.Refuse("token-role", tok.TenantID)
	}
	spent, err := tx.ConsumeJoinTokenUse(ctx, tok.ID)
	if err != nil {
		return nil, err
	}
	if !spent {
		// Expired between the read and the update (compute_now moved).
		return nil, attest.Refuse("token-expired", tok.TenantID)
	}
	expect, err := tokens.Expect(tok)
	if err != nil {
		return nil, err
	}
	return &attest.Admission{
		TenantID: tok.TenantID, PoolID: tok.PoolID, SiteID: tok.SiteID, Role: tok.Role,
		Expect: expect, AllowReclaim: tok.AllowReclaim, Hosted: tok.Hosted, JoinTokenID: tok.ID,
		NodeKey: "unattested",
	}, nil
}
