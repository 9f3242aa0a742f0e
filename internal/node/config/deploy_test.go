package config_test

import (
	"crypto/sha256"
	"encoding/base64"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/node/config"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// R18.3: the config.toml the Kubernetes DaemonSet seeds on each host is one
// bcd accepts once its placeholders are filled in (bcd refuses unknown keys,
// so a key renamed here and not there fails this test, not a fleet's pods).
func TestKubernetesConfigMapParsesR18_3(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("..", "..", "..", "deploy", "kubernetes", "base", "configmap.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	toml := configMapBlock(t, string(raw), "config.toml")
	sum := sha256.Sum256([]byte("pin"))
	pin := "sha256/" + base64.StdEncoding.EncodeToString(sum[:])
	toml = strings.ReplaceAll(toml, "sha256/REPLACE_ME", pin)
	toml = strings.ReplaceAll(toml, "site_REPLACE_ME", ids.New("site", time.Now()))
	c, err := config.Parse([]byte(toml))
	if err != nil {
		t.Fatalf("bcd refuses the DaemonSet's config.toml: %v\n%s", err, toml)
	}
	if c.Diagnostics.Listen != "127.0.0.1:9464" {
		t.Fatalf("diagnostics listen = %q; the DaemonSet's probes use 127.0.0.1:9464", c.Diagnostics.Listen)
	}
}

// configMapBlock returns the literal block scalar `key: |` of a ConfigMap's
// data, its indentation removed.
func configMapBlock(t *testing.T, yaml, key string) string {
	t.Helper()
	lines := strings.Split(yaml, "\n")
	for i, l := range lines {
		if strings.TrimSpace(l) != key+": |" {
			continue
		}
		indent := len(l) - len(strings.TrimLeft(l, " ")) + 2
		var b strings.Builder
		for _, body := range lines[i+1:] {
			if strings.TrimSpace(body) != "" && len(body)-len(strings.TrimLeft(body, " ")) < indent {
				break
			}
			if len(body) >= indent {
				body = body[indent:]
			}
			b.WriteString(strings.TrimRight(body, " ") + "\n")
		}
		return b.String()
	}
	t.Fatalf("no %q block in the ConfigMap", key)
	return ""
}
