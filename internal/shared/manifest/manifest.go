// Package manifest reads the pieces of deploy/kubernetes's YAML that the
// product's own tests check against the product (a ConfigMap's embedded
// config files), without a YAML dependency in the product's module: the
// manifests are written in the plain form these functions read.
package manifest

import (
	"os"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// Path is the path of a file under deploy/kubernetes, e.g.
// Path("control-plane", "configmap.yaml"), from the repository this
// package's source is in.
func Path(elem ...string) string {
	_, self, _, _ := runtime.Caller(0)
	root := filepath.Join(filepath.Dir(self), "..", "..", "..")
	return filepath.Join(append([]string{root, "deploy", "kubernetes"}, elem...)...)
}

// ConfigMapFile returns the literal block scalar `key: |` of the ConfigMap
// in file (a path under deploy/kubernetes), its indentation removed.
func ConfigMapFile(key string, file ...string) (string, error) {
	b, err := os.ReadFile(Path(file...))
	if err != nil {
		return "", err
	}
	return Block(string(b), key)
}

// Block returns the literal block scalar `key: |` of a YAML document, its
// indentation removed.
func Block(yaml, key string) (string, error) {
	return Literal(yaml, key+": |")
}

// Literal returns the literal block scalar whose first line is header
// (e.g. "config.toml: |", or "- |" for a list item such as a container's
// script), its indentation removed: the first one in the document.
func Literal(yaml, header string) (string, error) {
	lines := strings.Split(yaml, "\n")
	for i, l := range lines {
		if strings.TrimSpace(l) != header {
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
		return b.String(), nil
	}
	return "", errs.New(errs.InvalidArgument, "no block scalar %q", header)
}
