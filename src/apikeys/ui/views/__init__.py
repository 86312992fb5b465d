"""The settings page's views, one module per section of the page.

- `keys`: the list of keys (with the key just created or rolled, shown once) and creating
  a key;
- `edit`: editing a key; `states`: disabling, enabling and revoking; `roll`: rolling;
- `activity`: the workspace's audit trail; `usage`: one key's daily requests;
- `webhooks`: the deliveries of webhook events about the workspace's keys.

A new section is a module here with its views (`apikeys.ui.request.view` and `action`),
its template in `apikeys/ui/templates/`, and its routes added to `KeysPage`'s table.
"""
