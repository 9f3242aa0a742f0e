package server

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"log/slog"
	"sync"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/rotation"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/certfile"
)

// openRing opens the ring that makes bundle follow the database's keys
// (R16.1: a rotation reaches this replica without a restart) once its Run
// runs (serve's background work). Without a PKI there is nothing to
// follow: nil.
func openRing(ctx context.Context, db *store.DB, bundle *ca.Bundle, secret []byte, log *slog.Logger) (*rotation.Ring, error) {
	if bundle == nil {
		return nil, nil
	}
	return rotation.Open(ctx, rotation.Config{DB: db, Base: bundle, Secret: secret, Log: log})
}

// agentTLS is the agent listener's TLS: gateways' client certificates are
// verified against every accepted serving CA of the moment, and, when the
// certificate comes from files, a renewed agent certificate written over
// them is served from the next handshake on, without a restart.
func agentTLS(cfg Config, bundle *ca.Bundle, cert *tls.Certificate, fromFiles bool, log *slog.Logger) *tls.Config {
	base := &tls.Config{
		MinVersion: tls.VersionTLS12,
		ClientAuth: tls.RequireAndVerifyClientCert,
		NextProtos: []string{"h2", "http/1.1"},
	}
	certs := certfile.Fixed(cert)
	if fromFiles {
		// listenAgent loaded these files a moment ago; a failure now is a
		// race with their replacement, and the loaded pair stays.
		if p, err := certfile.LoadPair(cfg.Agent.CertFile, cfg.Agent.KeyFile, nil, log); err == nil {
			certs = p
		}
	}
	var mu sync.Mutex
	var poolOf *ca.Bundle
	var pool *x509.CertPool
	out := base.Clone()
	out.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) {
		b := bundle.Now()
		mu.Lock()
		if b != poolOf {
			pool = x509.NewCertPool()
			for _, c := range b.TrustedServingCAs() {
				pool.AddCert(c)
			}
			poolOf = b
		}
		p := pool
		mu.Unlock()
		c := base.Clone()
		c.ClientCAs = p
		c.Certificates = []tls.Certificate{*certs.Get()}
		return c, nil
	}
	return out
}
