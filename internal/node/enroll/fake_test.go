package enroll

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"io"
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/wire"

	"github.com/better-compute/better-compute/internal/checks/enrolltest"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

var discard = slog.New(slog.NewTextHandler(io.Discard, nil))

// env is one test's world: the fake gateway and JoinService
// (enrolltest.Server), a bcd config, a config path and a data directory.
type env struct {
	t        *testing.T
	srv      *enrolltest.Server
	fake     *enrolltest.JoinService
	now      time.Time
	clock    *clock.Fake
	bundle   *ca.Bundle
	pins     pki.Pins
	site     string
	token    string
	cfg      *bcdconfig.Config
	cfgPath  string
	store    *identity.Store
	progress []string
	// sleeps are the waits between attempts; each moves the clock.
	sleeps []time.Duration
	// callTimeout bounds one Join call (zero: the default).
	callTimeout time.Duration
}

type envOption struct {
	// gatewayBundle issues the gateway's certificate; nil: the env's own.
	gatewayBundle *ca.Bundle
	// noKeyFile leaves join-encryption.jwk out.
	noKeyFile bool
}

func newEnv(t *testing.T, o envOption) *env {
	t.Helper()
	s := enrolltest.New(t, enrolltest.Options{GatewayBundle: o.gatewayBundle})
	root := t.TempDir()
	e := &env{
		t: t, srv: s, fake: s.JoinService, now: s.Now, clock: clock.NewFake(s.Now),
		bundle: s.Bundle, pins: s.Pins, site: s.Site, token: s.Token,
		cfg: s.Config(t, root), cfgPath: filepath.Join(root, "etc", "bcd", "config.toml"),
	}
	if !o.noKeyFile {
		s.WriteKeyFile(t, filepath.Dir(e.cfgPath))
	}
	e.store = &identity.Store{Dir: e.cfg.DataDir}
	return e
}

func (e *env) setDoc(change func(d *wire.WellKnown)) { e.srv.SetDoc(change) }

// joiner returns a Joiner over the env; cfg nil is a host without
// config.toml.
func (e *env) joiner(cfg *bcdconfig.Config) *Joiner {
	e.t.Helper()
	j, err := New(e.config(cfg))
	if err != nil {
		e.t.Fatal(err)
	}
	return j
}

// config is the Joiner's Config over the env: waits between attempts move
// the env's clock instead of sleeping.
func (e *env) config(cfg *bcdconfig.Config) Config {
	return Config{
		BCD: cfg, ConfigPath: e.cfgPath, Store: e.store, Clock: e.clock,
		HTTPClient: e.srv.HTTPClient, Log: discard, CallTimeout: e.callTimeout, Rand: func() float64 { return 0.5 },
		Progress: func(line string) { e.progress = append(e.progress, line) },
		Sleep: func(ctx context.Context, d time.Duration) error {
			e.sleeps = append(e.sleeps, d)
			e.clock.Advance(d)
			return ctx.Err()
		},
	}
}

func (e *env) opts() Options { return Options{Token: e.token} }

func newToken(now time.Time) string { return enrolltest.NewToken(now) }

func newKey(t *testing.T) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}
