package server

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/rotation"
	"github.com/better-compute/better-compute/internal/controlplane/store"
)

// followKeys makes bundle follow the database's keys (R16.1: a rotation
// reaches this replica without a restart) until the returned stop runs.
// Without a PKI there is nothing to follow.
func followKeys(ctx context.Context, db *store.DB, bundle *ca.Bundle, secret []byte, log *slog.Logger) (stop func(), err error) {
	if bundle == nil {
		return func() {}, nil
	}
	ring, err := rotation.Open(ctx, rotation.Config{DB: db, Base: bundle, Secret: secret, Log: log})
	if err != nil {
		return nil, err
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		ring.Run(rctx)
	}()
	return func() { cancel(); <-done }, nil
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
	certs := &fileCert{cert: cert, log: log}
	if fromFiles {
		certs.certFile, certs.keyFile = cfg.Agent.CertFile, cfg.Agent.KeyFile
		certs.stamp = certs.mtimes()
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
		c.Certificates = []tls.Certificate{*certs.get()}
		return c, nil
	}
	return out
}

// fileCert is a certificate loaded from files, loaded again when they
// change (checked at most once a second).
type fileCert struct {
	certFile, keyFile string
	log               *slog.Logger

	mu      sync.Mutex
	cert    *tls.Certificate
	stamp   string
	checked time.Time
}

func (f *fileCert) mtimes() string {
	var s string
	for _, p := range []string{f.certFile, f.keyFile} {
		if fi, err := os.Stat(p); err == nil {
			s += fi.ModTime().String() + "/" + p + ";"
		}
	}
	return s
}

func (f *fileCert) get() *tls.Certificate {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.certFile == "" || time.Since(f.checked) < time.Second {
		return f.cert
	}
	f.checked = time.Now()
	if st := f.mtimes(); st != f.stamp {
		c, err := tls.LoadX509KeyPair(f.certFile, f.keyFile)
		if err != nil {
			// A pair caught half-written, or a bad one: keep serving
			// the last good one and look again later.
			f.log.Warn("agent certificate changed but does not load; the previous one stays", "err", err)
			return f.cert
		}
		f.cert, f.stamp = &c, st
		f.log.Info("agent certificate reloaded", "cert_file", f.certFile)
	}
	return f.cert
}
