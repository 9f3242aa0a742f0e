// Package jointoken is the join-token attestor: it reads the token row,
// checks the secret in constant time, revocation, expiry at compute_now(),
// the uses left and the role, and hands JoinService the spending of one use
// as the admission transaction's last statement (so a refusal later in the
// join gives the use back, and the token row, hot when a token has many
// uses, is locked only from the spend to the commit).
package jointoken

import (
	"context"
	"errors"
	"fmt"

	"github.com/better-compute/better-compute/internal/controlplane/join/attest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	tokens "github.com/better-compute/better-compute/internal/controlplane/tokens"
	"github.com/better-compute/better-compute/internal/shared/secret"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// Name of the attestor.
const Name = wire.AttestorJoinToken

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
	// A plain read, no lock: Spend re-checks the token as it takes the use.
	// It asks whether a use is left, not how many: the spend counts.
	tok, err := tx.GetJoinTokenForJoin(ctx, id)
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
	if reason := stateRefusal(tok); reason != "" {
		return nil, attest.Refuse(reason, tok.TenantID)
	}
	if tok.Role != in.Role {
		return nil, attest.Refuse("token-role", tok.TenantID)
	}
	expect, err := tokens.ParseExpect(tok.ID, tok.Expect)
	if err != nil {
		return nil, err
	}
	return &attest.Admission{
		TenantID: tok.TenantID, PoolID: tok.PoolID, SiteID: tok.SiteID, Role: tok.Role,
		Expect: expect, AllowReclaim: tok.AllowReclaim, Hosted: tok.Hosted, JoinTokenID: tok.ID,
		NodeKey: "unattested",
		Spend:   func(ctx context.Context, tx *store.Tx) error { return spend(ctx, tx, tok) },
	}, nil
}

// spend takes one use of tok, refusing when none is left. The UPDATE checks
// uses, revocation and expiry itself: on PostgreSQL it waits for a
// concurrent join holding the row and re-evaluates them on the row that join
// committed, so a token never gives more uses than it has.
func spend(ctx context.Context, tx *store.Tx, tok store.AdmissionToken) error {
	spent, err := tx.ConsumeJoinTokenUse(ctx, tok.ID)
	if err != nil {
		return err
	}
	if spent {
		return nil
	}
	// The token changed since the read: tell why.
	now, err := tx.GetJoinTokenForJoin(ctx, tok.ID)
	if err != nil {
		return fmt.Errorf("read join token: %w", err)
	}
	if reason := stateRefusal(now); reason != "" {
		return attest.Refuse(reason, tok.TenantID)
	}
	// Live at the re-read but not at the update: only compute_now() moving
	// back (tests) does that; the update saw the token expired.
	return attest.Refuse("token-expired", tok.TenantID)
}

// stateRefusal is the refusal reason for a token that is not live, or "".
func stateRefusal(tok store.AdmissionToken) string {
	switch tokens.AdmissionState(tok) {
	case tokens.StateRevoked:
		return "token-revoked"
	case tokens.StateUsedUp:
		return "token-used-up"
	case tokens.StateExpired:
		return "token-expired"
	}
	return ""
}
