package bcdconfig_test

import (
	"crypto/sha256"
	"encoding/base64"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/manifest"
)

// R18.3: the config.toml the Kubernetes DaemonSet seeds on each host is one
// bcd accepts once its placeholders are filled in (bcd refuses unknown keys,
// so a key renamed here and not there fails this test, not a fleet's pods).
func TestKubernetesConfigMapParsesR18_3(t *testing.T) {
	toml, err := manifest.ConfigMapFile("config.toml", "base", "configmap.yaml")
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256([]byte("pin"))
	pin := "sha256/" + base64.StdEncoding.EncodeToString(sum[:])
	toml = strings.ReplaceAll(toml, "sha256/REPLACE_ME", pin)
	toml = strings.ReplaceAll(toml, "site_REPLACE_ME", ids.New("site", time.Now()))
	c, err := bcdconfig.Parse([]byte(toml))
	if err != nil {
		t.Fatalf("bcd refuses the DaemonSet's config.toml: %v\n%s", err, toml)
	}
	if c.Diagnostics.Listen != "127.0.0.1:9464" {
		t.Fatalf("diagnostics listen = %q; the DaemonSet's probes use 127.0.0.1:9464", c.Diagnostics.Listen)
	}
}
