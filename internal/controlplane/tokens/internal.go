package tokens

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/secret"
)

// SecretSink keeps a secret a module minted and answers a reference to it
// (R2.7): site and ramdisk tokens travel only as references, to the boot
// image or the site agent's installer, never through the API or a log.
type SecretSink interface {
	// Put stores secret under name and returns its reference.
	Put(name string, secret []byte) (ref string, err error)
}

// FileSink keeps each secret in a new file of Dir, readable by its owner
// only (0600); the reference is "file:<path>". bcd join --token-file
// reads such a file.
type FileSink struct{ Dir string }

// Put implements SecretSink. It never overwrites a file.
func (s FileSink) Put(name string, secret []byte) (string, error) {
	if name == "" || filepath.Base(name) != name {
		return "", fmt.Errorf("secret name %q: want a plain file name", name)
	}
	if err := os.MkdirAll(s.Dir, 0o700); err != nil {
		return "", fmt.Errorf("create %s: %w", s.Dir, err)
	}
	path := filepath.Join(s.Dir, name)
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return "", fmt.Errorf("keep the secret: %w", err)
	}
	if _, err := f.Write(append(secret, '\n')); err != nil {
		f.Close()
		os.Remove(path)
		return "", fmt.Errorf("keep the secret: %w", err)
	}
	if err := f.Close(); err != nil {
		os.Remove(path)
		return "", fmt.Errorf("keep the secret: %w", err)
	}
	return "file:" + path, nil
}

// InternalRequest is a module's request for a site or ramdisk token.
type InternalRequest struct {
	// Module names the module (recorded as the token's creator,
	// "module:<name>").
	Module           string
	TenantID, PoolID string
	// Role is RoleSite or RoleRamdisk.
	Role    string
	TTL     time.Duration
	MaxUses int
	// SecretName is the name the sink keeps the bearer token under.
	SecretName string
}

// MintInternal mints a site or ramdisk token for a module (R2.7): not an
// API call, for the control plane's own modules (a site's boot service,
// dev). The bearer token goes to sink only; the caller gets the token row
// and the reference. A sink that fails leaves no token behind.
func (s *Service) MintInternal(ctx context.Context, sink SecretSink, r InternalRequest) (store.JoinToken, string, error) {
	switch {
	case r.Role != RoleSite && r.Role != RoleRamdisk:
		return store.JoinToken{}, "", errs.Invalid("role", "modules mint %s or %s tokens; node tokens come from the API", RoleSite, RoleRamdisk)
	case r.Module == "":
		return store.JoinToken{}, "", errs.Invalid("module", "required")
	case r.TTL < MinTTL || r.TTL > MaxTTL || r.TTL%time.Second != 0:
		return store.JoinToken{}, "", errs.Invalid("ttl", "want whole seconds from %s to %s", MinTTL, MaxTTL)
	case r.MaxUses < 1 || r.MaxUses > MaxMaxUses:
		return store.JoinToken{}, "", errs.Invalid("maxUses", "want 1 to %d", MaxMaxUses)
	}
	var tok store.JoinToken
	var ref string
	err := s.db.WithTx(ctx, func(tx *store.Tx) error {
		pool, err := tenancy.OwnedPool(ctx, tx, r.TenantID, r.PoolID)
		if err != nil {
			return err
		}
		if pool.Agent != tenancy.AgentBCD {
			return errs.New(errs.InvalidState, "pool %s runs no daemon (agent %q)", pool.ID, pool.Agent)
		}
		now, err := tx.Now(ctx)
		if err != nil {
			return err
		}
		plain, sum := secret.Mint()
		creator := "module:" + r.Module
		if tok, err = tx.InsertJoinToken(ctx, store.JoinToken{
			ID: ids.New(ids.JoinToken, now), TenantID: r.TenantID, PoolID: pool.ID, SiteID: pool.SiteID, Role: r.Role,
			SecretSHA256: sum, MaxUses: r.MaxUses, Expect: []byte("{}"), CreatedBy: creator,
		}, r.TTL); err != nil {
			return err
		}
		data := map[string]any{"tokenId": tok.ID, "poolId": pool.ID, "siteId": pool.SiteID, "role": tok.Role, "maxUses": tok.MaxUses,
			"expiresAt": tok.ExpiresAt, "pinned": false, "allowReclaim": false, "createdBy": creator}
		if err := events.Publish(ctx, tx, s.hub, events.Event{TenantID: r.TenantID, Type: "security.join-token.created", Subject: tok.ID, Data: data}); err != nil {
			return err
		}
		if err := events.Audit(ctx, tx, events.Entry{TenantID: r.TenantID, Actor: creator, Action: "join-token.created", Resource: authz.PoolResource(pool.ID), Data: data}); err != nil {
			return err
		}
		// Last: a sink that fails rolls the token back.
		ref, err = sink.Put(r.SecretName, []byte(secret.Format(Scheme, tok.ID, plain)))
		return err
	})
	if err != nil {
		var e *errs.E
		if !errors.As(err, &e) {
			err = fmt.Errorf("mint a %s token: %w", r.Role, err)
		}
		return store.JoinToken{}, "", err
	}
	return tok, ref, nil
}
