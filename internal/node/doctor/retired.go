package doctor

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/fsutil"
)

// RetiredFile, in the identity's directory, records that the control plane
// told bcd run this node was retired. Only a session learns it (the
// certificate stays valid until it expires), so without the record bcd
// doctor called a retired node healthy. It names the certificate it was
// said of: a later join (bcd join --reset, then bcd join) makes a new one
// and the record no longer applies.
const RetiredFile = "retired.json"

type retiredRecord struct {
	NodeID string    `json:"node_id"`
	Serial string    `json:"serial"`
	At     time.Time `json:"at"`
}

// RecordRetired writes RetiredFile for id (bcd run, as it stops).
func RecordRetired(dir string, id *identity.Identity, at time.Time) error {
	b, err := json.Marshal(retiredRecord{NodeID: id.NodeID, Serial: id.Serial, At: at.UTC()})
	if err != nil {
		return err
	}
	return fsutil.WriteFileAtomic(filepath.Join(dir, RetiredFile), b, 0o600)
}

// retiredAt returns when bcd run was told id's node was retired, if it was.
func retiredAt(dir string, id *identity.Identity) (time.Time, bool, error) {
	b, err := os.ReadFile(filepath.Join(dir, RetiredFile))
	if errors.Is(err, fs.ErrNotExist) {
		return time.Time{}, false, nil
	}
	if err != nil {
		return time.Time{}, false, err
	}
	var r retiredRecord
	if err := json.Unmarshal(b, &r); err != nil {
		return time.Time{}, false, fmt.Errorf("%s: %w", RetiredFile, err)
	}
	return r.At, r.NodeID == id.NodeID && r.Serial == id.Serial, nil
}

// retiredMessage is doctor's detail for a retired node.
func retiredMessage(id *identity.Identity, at time.Time) string {
	return fmt.Sprintf("node %s was retired (the control plane said so to bcd run at %s): it can no longer connect or renew. To use this machine again, join it anew as root: bcd join --reset --yes, then bcd join with a new token",
		id.NodeID, at.UTC().Format(time.RFC3339))
}
