package backup

import (
	"encoding/json"
	"fmt"
	"path"
	"strings"
	"time"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// Format is the archive format this package writes and reads.
const Format = 1

// Members of the archive. The manifest comes first, so a restore checks
// the format and schema before it extracts anything.
const (
	memberManifest = "manifest.json"
	memberDB       = "db/bc.db"
	pkiPrefix      = "pki/"
)

// Limits on what a restore reads, so a damaged or hostile archive cannot
// make it spend unbounded memory: the manifest is read whole, the members
// are streamed.
const (
	maxManifestBytes = 1 << 20
	maxMembers       = 1000
)

// Manifest is manifest.json: what the archive holds and what it was taken
// from.
type Manifest struct {
	Format    int       `json:"format"`
	CreatedAt time.Time `json:"createdAt"`
	// SchemaVersion is the highest migration applied to the copied
	// database.
	SchemaVersion int64 `json:"schemaVersion"`
	// Store is the database kind: "sqlite".
	Store string `json:"store"`
	// TrustDomain is the PKI bundle's SPIFFE trust domain ("" without a
	// PKI directory).
	TrustDomain string `json:"trustDomain"`
	// Files are every other member, in archive order.
	Files []File `json:"files"`
}

// File is one member of the archive.
type File struct {
	Name   string `json:"name"`
	Size   int64  `json:"size"`
	SHA256 string `json:"sha256"`
}

// damaged is the error of an archive that is not what its manifest says.
func damaged(format string, args ...any) error {
	return errs.Invalid("--in", "the backup archive is damaged: "+format, args...)
}

// parseManifest reads and checks manifest.json.
func parseManifest(b []byte) (Manifest, error) {
	var m Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return m, damaged("manifest.json: %v", err)
	}
	if m.Format != Format {
		return m, errs.New(errs.InvalidState, "backup format %d: this binary reads format %d", m.Format, Format)
	}
	if m.Store != "sqlite" {
		return m, damaged("store %q: want sqlite", m.Store)
	}
	if len(m.Files) > maxMembers {
		return m, damaged("%d members, at most %d", len(m.Files), maxMembers)
	}
	seen := map[string]bool{}
	for _, f := range m.Files {
		if err := checkName(f.Name); err != nil {
			return m, err
		}
		if seen[f.Name] || f.Size < 0 || len(f.SHA256) != 64 {
			return m, damaged("manifest entry %q", f.Name)
		}
		seen[f.Name] = true
	}
	if !seen[memberDB] {
		return m, damaged("no database copy (%s)", memberDB)
	}
	return m, nil
}

// checkName accepts the database member and clean relative paths under
// pki/. SECURITY: a member name becomes a path under the staging
// directory; nothing may climb out of it.
func checkName(name string) error {
	if name == memberDB {
		return nil
	}
	rel, ok := strings.CutPrefix(name, pkiPrefix)
	if !ok || rel == "" || path.Clean(rel) != rel || path.IsAbs(rel) || rel == ".." || strings.HasPrefix(rel, "../") || strings.ContainsAny(name, "\\\x00") {
		return damaged("member name %q", name)
	}
	return nil
}

func (m Manifest) file(name string) (File, bool) {
	for _, f := range m.Files {
		if f.Name == name {
			return f, true
		}
	}
	return File{}, false
}

func (f File) String() string { return fmt.Sprintf("%s (%d bytes)", f.Name, f.Size) }
