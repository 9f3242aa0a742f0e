package cli

import (
	"os"
	"strings"

	"github.com/better-compute/better-compute/internal/controlplane/server"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// devOwned are the server options dev decides itself: where its data,
// keys and listeners are (the banner, dev.env and the bcd configs name
// them). A --config file setting one is refused rather than silently
// half-applied.
var devOwned = []string{
	"listen", "base_path", "root_tenant", "tls", "store", "pki", "agent", "downloads",
	"gateway.url", "gateway.listen", "gateway.cert_file", "gateway.key_file", "gateway.api_url", "gateway.api_urls", "gateway.api_ca_file",
}

// devOverlay applies dev --config FILE over dev's own server config, so
// every other option of serve's config ([join] svid_form, [limits],
// [export], [tracing], …) can be tried on a laptop.
func devOverlay(cfg server.Config, path string) (server.Config, error) {
	if path == "" {
		return cfg, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return cfg, errs.Invalid("--config", "%v", err)
	}
	out, keys, err := server.Overlay(cfg, b)
	if err != nil {
		return cfg, err
	}
	for _, k := range keys {
		for _, own := range devOwned {
			if k == own || strings.HasPrefix(k, own+".") {
				return cfg, errs.Invalid("--config", "%s sets %s, which dev decides itself (its --data-dir, --listen and --gateway-listen); use serve for that", path, own)
			}
		}
	}
	return out, nil
}
