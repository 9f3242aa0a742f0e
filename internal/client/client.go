// Package client is the typed Go client of the operator API, used by the CLI,
// the web console and tests. It is a client of the API like any other, so it
// depends on no process's code (the dependency test holds it to that) and
// bcd does not link it. Errors come back as *errs.E with the product code.
package client

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/better-compute/better-compute/internal/shared/wire"

	"connectrpc.com/connect"

	"github.com/better-compute/better-compute/gen/bettercompute/v1/bcv1connect"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// Config says where the API is and how to authenticate.
type Config struct {
	// URL is the control plane, e.g. https://compute.example.com; the base
	// path /api/compute is added unless the URL already ends with a path.
	URL    string
	APIKey string
	// CAFile, when set, is the PEM of CAs that verify the server.
	CAFile     string
	HTTPClient *http.Client
}

// Client is an operator API client.
type Client struct {
	Tenants    bcv1connect.TenantServiceClient
	Sites      bcv1connect.SiteServiceClient
	Pools      bcv1connect.PoolServiceClient
	APIKeys    bcv1connect.ApiKeyServiceClient
	JoinTokens bcv1connect.JoinTokenServiceClient
	// JoinRequests lists and decides join requests (R10).
	JoinRequests bcv1connect.JoinRequestServiceClient
	Events       bcv1connect.EventServiceClient
	Nodes        bcv1connect.NodeServiceClient
	Commands     bcv1connect.CommandServiceClient
	// Base is the API's base URL, path included.
	Base string
}

// BaseURL returns the API base URL for a control-plane URL.
func BaseURL(u string) string {
	u = strings.TrimRight(u, "/")
	rest := u
	if i := strings.Index(u, "://"); i >= 0 {
		rest = u[i+3:]
	}
	if !strings.Contains(rest, "/") {
		u += wire.DefaultBasePath
	}
	return u
}

// New returns a Client.
func New(cfg Config) (*Client, error) {
	if cfg.URL == "" {
		return nil, errs.New(errs.InvalidConfig, "no control plane URL: set BETTER_COMPUTE_URL or pass --url")
	}
	hc := cfg.HTTPClient
	if hc == nil {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		if cfg.CAFile != "" {
			pem, err := os.ReadFile(cfg.CAFile)
			if err != nil {
				return nil, errs.Wrap(err, errs.InvalidConfig, "read CA file: %v", err)
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(pem) {
				return nil, errs.New(errs.InvalidConfig, "CA file %s holds no PEM certificate", cfg.CAFile)
			}
			tr.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
		}
		hc = &http.Client{Transport: tr, Timeout: 60 * time.Second}
	}
	base := BaseURL(cfg.URL)
	opts := []connect.ClientOption{connect.WithInterceptors(authInterceptor(cfg.APIKey))}
	return &Client{
		Tenants:      bcv1connect.NewTenantServiceClient(hc, base, opts...),
		Sites:        bcv1connect.NewSiteServiceClient(hc, base, opts...),
		Pools:        bcv1connect.NewPoolServiceClient(hc, base, opts...),
		APIKeys:      bcv1connect.NewApiKeyServiceClient(hc, base, opts...),
		JoinTokens:   bcv1connect.NewJoinTokenServiceClient(hc, base, opts...),
		JoinRequests: bcv1connect.NewJoinRequestServiceClient(hc, base, opts...),
		Events:       bcv1connect.NewEventServiceClient(hc, base, opts...),
		Nodes:        bcv1connect.NewNodeServiceClient(hc, base, opts...),
		Commands:     bcv1connect.NewCommandServiceClient(hc, base, opts...),
		Base:         base,
	}, nil
}

// authInterceptor adds the API key and turns wire errors into *errs.E.
func authInterceptor(key string) connect.UnaryInterceptorFunc {
	return func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			if key != "" {
				req.Header().Set("Authorization", "Bearer "+key)
			}
			res, err := next(ctx, req)
			if err != nil {
				return nil, wire.FromWire(err)
			}
			return res, nil
		}
	}
}
