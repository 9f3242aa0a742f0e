package backup

import (
	"encoding/json"
	"fmt"
	"path"
	"strings"
	"time"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// Format is the archive format this package writes: a manifest and its
// MAC (mac.go). It also reads FormatUnauthenticated, the format of older
// releases, whose archives carry no MAC, when told to (--unauthenticated).
const (
	Format                = 2
	FormatUnauthenticated = 1
)

// Members of the archive. The manifest comes first, so a restore checks
// the format and schema before it extracts anything.
const (
	memberManifest = "manifest.json"
	memberDB       = "db/bc.db"
	pkiPrefix      = "pki/"
)

// Limits on what a restore reads, so a damaged or hostile archive cannot
// make it spend unbounded memory or disk: the manifest is read whole, the
// members are streamed, each bounded by its size in the manifest, a PKI
// file by maxPKIFileBytes too, and all of them together by the free space
// where they are written (restore.go).
const (
	maxManifestBytes = 1 << 20
	maxMembers       = 1000
	maxPKIFileBytes  = 1 << 20
	// maxMemberBytes (1 PiB) only keeps the sum of sizes from overflowing.
	maxMemberBytes = 1 << 50
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

// checkFormat refuses a manifest of a format this binary does not read,
// before anything else is checked: an archive of a newer release is not
// damaged, it needs that release.
func checkFormat(b []byte) error {
	var m struct{ Format int }
	if err := json.Unmarshal(b, &m); err != nil {
		return damaged("manifest.json: %v", err)
	}
	if m.Format != Format && m.Format != FormatUnauthenticated {
		return errs.New(errs.InvalidState, "backup format %d: this binary reads formats %d and %d", m.Format, FormatUnauthenticated, Format)
	}
	return nil
}

// parseManifest reads and checks manifest.json; authenticated says whether
// its MAC was checked.
func parseManifest(b []byte, authenticated bool) (Manifest, error) {
	var m Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return m, damaged("manifest.json: %v", err)
	}
	if err := checkFormat(b); err != nil {
		return m, err
	}
	if authenticated != (m.Format == Format) {
		// A format 2 manifest without its MAC had it stripped; a format 1
		// manifest with one was not written by backup.
		return m, damaged("a format %d manifest %s %s", m.Format, map[bool]string{true: "with", false: "without"}[authenticated], memberMAC)
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
		if seen[f.Name] || f.Size < 0 || f.Size > maxMemberBytes || len(f.SHA256) != 64 {
			return m, damaged("manifest entry %q", f.Name)
		}
		if f.Name != memberDB && f.Size > maxPKIFileBytes {
			return m, damaged("%s: %d bytes, a PKI file is at most %d", f.Name, f.Size, maxPKIFileBytes)
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

// size is the bytes of every member together.
func (m Manifest) size() int64 {
	var n int64
	for _, f := range m.Files {
		n += f.Size
	}
	return n
}

func (f File) String() string { return fmt.Sprintf("%s (%d bytes)", f.Name, f.Size) }
